from __future__ import annotations

from engines.sim.cli import main

main()

from pdproxy.cli import main

main()

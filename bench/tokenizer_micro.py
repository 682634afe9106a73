"""What ``--tokenizer`` costs per request: a ~1k-token completion and chat prompt tokenized
as ``pdproxy.wire.local_tokenizer`` does, on the event loop and through
``PromptTokens``' thread (wall time, and the loop's own CPU while it waits).

Run: ``python -m bench.tokenizer_micro [MODEL_DIR]`` (default: engines/vllm's SmolLM2 in
``~/.cache/pdproxy/models``, which has a tokenizer.json and a chat template).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from pdproxy.proxying.prompt_tokens import PromptTokens
from pdproxy.scheduling.context import RequestFeatures
from pdproxy.wire.local_tokenizer import LocalTokenizer

DEFAULT_DIR = Path.home() / ".cache" / "pdproxy" / "models" / "smollm2-135m-instruct"
SENTENCE = (
    "The scheduler keeps every engine busy and routes each prompt to the instance whose "
    "cache already holds its longest prefix, weighing that against the queue it would join. "
)


def per_call_us(fn, n: int = 300) -> float:
    """The best of 5 rounds' mean, in microseconds of process CPU (the machine is shared)."""
    best = float("inf")
    for _ in range(5):
        start = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, (time.process_time() - start) / n * 1e6)
    return best


async def threaded(filler: PromptTokens, body: dict, n: int = 300) -> tuple[float, float]:
    """The mean wall time of ``fill`` through the thread, and the loop thread's own CPU
    per call (what the loop cannot spend on other requests)."""
    features = RequestFeatures(model="m")
    await filler.fill(body, features)  # the threads start
    wall, cpu = float("inf"), float("inf")
    for _ in range(5):
        start, start_cpu = time.perf_counter(), time.thread_time()
        for _ in range(n):
            await filler.fill(body, features)
        wall = min(wall, (time.perf_counter() - start) / n * 1e6)
        cpu = min(cpu, (time.thread_time() - start_cpu) / n * 1e6)
    return wall, cpu


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR
    tokenizer = LocalTokenizer.load(str(folder))
    text = SENTENCE * 40
    completion = {"model": "m", "prompt": text}
    chat = {
        "model": "m",
        "messages": [
            {"role": "system", "content": SENTENCE * 20},
            {"role": "user", "content": SENTENCE * 20},
        ],
    }
    ids = tokenizer.prompt_ids(completion) or []
    chat_ids = tokenizer.prompt_ids(chat) or []
    short = {"model": "m", "prompt": SENTENCE * 4}
    print(f"tokenizer: {folder}; prompt: {len(text)} chars, {len(ids)} tokens")
    rows = (
        ("completion", completion, len(ids)),
        ("chat", chat, len(chat_ids)),
        ("short completion", short, len(tokenizer.prompt_ids(short) or [])),
    )
    for name, body, n in rows:
        cost = per_call_us(lambda body=body: tokenizer.prompt_ids(body))
        print(f"{name} ({n} tokens), on the loop: {cost:8.1f} us")
    filler = PromptTokens({"": tokenizer}, lambda _: True)
    try:
        for name, body in (("completion", completion), ("chat", chat)):
            wall, cpu = asyncio.run(threaded(filler, body))
            print(f"{name}, on the thread: {wall:8.1f} us wall, {cpu:6.1f} us of the loop's CPU")
    finally:
        filler.close()


if __name__ == "__main__":
    main()

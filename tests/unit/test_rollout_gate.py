"""The rollout server's gate: generations overlap, a weight swap runs alone and is not starved."""

import asyncio

from grpo_rollout.gate import Gate


async def _scenario() -> list[str]:
    gate, log = Gate(), []
    first_in, release_first, swap_waiting = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def generation(name: str, hold: asyncio.Event | None = None, entered: asyncio.Event | None = None):
        async with gate.shared():
            log.append(f"{name} in")
            if entered:
                entered.set()
            if hold:
                await hold.wait()
            log.append(f"{name} out")

    async def swap():
        swap_waiting.set()
        async with gate.exclusive():
            log.append("swap")

    a = asyncio.create_task(generation("a", hold=release_first, entered=first_in))
    await first_in.wait()
    await generation("b")  # overlaps a running generation
    s = asyncio.create_task(swap())
    await swap_waiting.wait()
    await asyncio.sleep(0)  # the swap is now queued behind a
    c = asyncio.create_task(generation("c"))  # arrives after the swap: must wait for it
    await asyncio.sleep(0)
    assert "c in" not in log and "swap" not in log
    release_first.set()
    await asyncio.gather(a, s, c)
    return log


def test_generations_overlap_and_a_swap_waits_for_them_then_goes_before_newcomers():
    log = asyncio.run(_scenario())
    assert log == ["a in", "b in", "b out", "a out", "swap", "c in", "c out"]

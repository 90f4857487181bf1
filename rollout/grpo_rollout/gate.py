"""Many generations or one weight swap at a time, for a rollout server whose engine batches
concurrent requests (vLLM): every response must be sampled with exactly one weight version.

`RolloutService` holds `shared()` around each generate and `exclusive()` around each weight swap.
A waiting swap closes the gate to new generations (they queue behind it), so a steady stream of
requests cannot postpone a new version forever; the generations already running finish first.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator


class Gate:
    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._running = 0  # generations holding the gate
        self._swapping = False
        self._waiting_swaps = 0

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._swapping and not self._waiting_swaps)
            self._running += 1
        try:
            yield
        finally:
            async with self._cond:
                self._running -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            self._waiting_swaps += 1
            try:
                await self._cond.wait_for(lambda: not self._swapping and not self._running)
            finally:
                self._waiting_swaps -= 1
            self._swapping = True
        try:
            yield
        finally:
            async with self._cond:
                self._swapping = False
                self._cond.notify_all()

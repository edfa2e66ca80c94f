"""Targets polled when asked, outside the scheduler: `top --target/--config` polls them at every read,
`kv-math --target` once. The only part of the runtime that consumers (the `top` view) may use.

Each target keeps its state between polls (histories for the pressure state, failure counts), as
under the scheduler. The polls and the close run in one thread: the targets' connections belong
to the object's event loop.
"""

from __future__ import annotations

import asyncio

from ..config import Config
from .target import PollOutcome, Target, new_target


class DirectPolls:
    def __init__(self, config: Config):
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.targets: list[Target] = [new_target(t, config) for t in config.targets]

    def poll_once(self) -> list[PollOutcome]:
        """Every target polled once, concurrently. A failed poll is counted by its target (its
        `failures`, target_up 0), never raised."""
        return self.loop.run_until_complete(self._poll_all())

    async def _poll_all(self) -> list[PollOutcome]:
        return list(await asyncio.gather(*(target.poll() for target in self.targets)))

    def close(self) -> None:
        for target in self.targets:
            target.close()
        self.loop.run_until_complete(asyncio.sleep(0))  # the closed connections let go of their sockets
        self.loop.close()

    def __enter__(self) -> DirectPolls:
        return self

    def __exit__(self, *_) -> None:
        self.close()

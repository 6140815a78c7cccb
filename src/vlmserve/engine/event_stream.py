"""One request's events as the event loop reads them, shared by the in-process engine and
the engine-process client. No MLX here: the client's process never imports it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from vlmserve.protocol import TokenEvent


async def read_events(queue: asyncio.Queue, on_early_exit: Callable[[], None]) -> AsyncIterator[TokenEvent]:
    """Yield a request's events up to and including its final one; leaving early calls on_early_exit.

    A reader behind the steps takes what has queued up as one event (vLLM's output collector
    does the same): one chunk and one socket write instead of several. An error or abort stays
    an event of its own, after the text before it.
    """
    finished = False
    held: TokenEvent | None = None
    try:
        while True:
            event = held if held is not None else await queue.get()
            held = None
            while event.finish_reason is None and not queue.empty():
                after = queue.get_nowait()
                if after.finish_reason is not None and after.finish_reason.failed:
                    held = after
                    break
                event = joined(event, after)
            if event.finish_reason is not None:
                finished = True
            yield event
            if finished:
                return
    finally:
        if not finished:
            on_early_exit()


def joined(first: TokenEvent, then: TokenEvent) -> TokenEvent:
    """Two consecutive events of one request as one; `first` is not its last."""
    return replace(
        then,
        text=first.text + then.text,
        token_ids=first.token_ids + then.token_ids,
        logprobs=first.logprobs + then.logprobs,
    )


def deliver(items) -> None:
    """(queue, event) pairs into their queues: one event-loop callback per engine step."""
    for queue, event in items:
        queue.put_nowait(event)

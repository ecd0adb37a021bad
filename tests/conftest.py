"""Fixtures shared by several test modules."""

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from a second thread, and on a shared 2-core box two threads stall each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ranks() -> Iterator:
    """A server forking real gloo ranks that run tests/ckpt_worker.py's scenarios (and the crash loop);
    imported here, not at the top, so only the multi-process modules pay for torch.distributed."""
    from checkpointing.crashtest import RankServer

    server = RankServer("tests.ckpt_worker")
    yield server
    server.close()

"""process_tuning: what the OS shows of our threads."""

import sys
import threading
from pathlib import Path

import pytest

from pagedserve.backend.process_tuning import name_native_thread


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux thread names")
def test_a_thread_named_natively_shows_its_first_15_bytes_in_proc():
    seen = []

    def run() -> None:
        assert name_native_thread("pagedserve-responses")
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == ["pagedserve-resp"]

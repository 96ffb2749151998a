"""The shared-memory buffer of FSDP's CPU collectives: a buffer that does not fit is refused at
creation, with the size and the reason, and leaves no file behind (so the group falls back to
gloo instead of dying of SIGBUS when it first writes past what /dev/shm holds)."""

import glob
import os

from kiln.parallel.shared_memory_collectives import _create_buffer_file


def test_a_buffer_that_does_not_fit_is_refused_and_leaves_no_file():
    before = set(glob.glob("/dev/shm/kiln-fsdp-*"))
    answer = _create_buffer_file(2**60)
    assert answer.startswith("error: 1099511627776 MiB in "), answer
    assert set(glob.glob("/dev/shm/kiln-fsdp-*")) == before


def test_a_buffer_that_fits_is_reserved_in_full():
    path = _create_buffer_file(3 * 2**20)
    try:
        assert os.path.basename(path).startswith("kiln-fsdp-"), path
        assert os.stat(path).st_blocks * 512 >= 3 * 2**20  # allocated, not a sparse file
    finally:
        os.unlink(path)

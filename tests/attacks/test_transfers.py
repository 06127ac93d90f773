"""attacks.transfers off a CUDA device: plain copies (the CUDA forms run in
tests/privkit/test_on_device.py with PRIVKIT_TEST_DEVICE=cuda)."""

import torch

from attacks.transfers import HostCopy, to_device


def test_to_device_is_the_tensor_there():
    t = torch.arange(5.0)
    assert torch.equal(to_device(t, torch.device("cpu")), t)
    assert to_device(t, torch.device("meta")).device.type == "meta"


def test_a_host_copy_keeps_the_values_it_was_made_with():
    t = torch.arange(6.0)
    copy = HostCopy(t)
    t.zero_()
    assert torch.equal(copy.result(), torch.arange(6.0))
    assert copy.result() is copy.result()  # read once, kept

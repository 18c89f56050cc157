"""Output collation: collected outputs are copies that own their memory."""

from __future__ import annotations

import torch

from ppetrace.training._collate import OutputCollector, to_host


def test_collected_cpu_outputs_are_copies_not_views_of_the_step_tensors() -> None:
    collector = OutputCollector()
    first = torch.arange(4.0)
    second = torch.arange(4.0, 8.0)
    collector.add((first,))
    collector.add((second,))
    first.add_(100.0)  # the step's tensors change after collation (e.g. reused buffers)
    second.zero_()
    (collated,) = collector.collated()
    assert collated.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]


def test_a_collected_view_does_not_keep_its_base_storage_alive() -> None:
    base = torch.zeros(1_000, 256)
    row = base[0]  # a 1 KiB view of a 1 MB storage
    collector = OutputCollector(max_bytes=4096)
    (kept,) = collector.add((row,))
    assert collector.nbytes == 1024
    assert kept.untyped_storage().nbytes() == 1024  # the bound counts what is really held
    (host,) = to_host((row,))
    assert host.untyped_storage().nbytes() == 1024
    assert host.data_ptr() != row.data_ptr()


def test_other_values_pass_through_and_grad_is_detached() -> None:
    weight = torch.ones(2, requires_grad=True)
    loss = (weight * 2).sum()
    kept, label = to_host((loss, "a"))
    assert not kept.requires_grad and kept.item() == 4.0
    assert label == "a"

"""Output collation: collected outputs are copies that own their memory."""

from __future__ import annotations

import pytest
import torch

from ppetrace.training._collate import OutputCollector, collate, to_host


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


def test_dict_outputs_are_collated_key_by_key_and_counted_in_the_bound() -> None:
    steps = [({"pred": torch.ones(2, 3), "loss": torch.tensor(1.0)},) for _ in range(3)]
    ((out,),) = (collate(steps),)
    assert (
        set(out) == {"pred", "loss"} and out["pred"].shape == (6, 3) and out["loss"].shape == (3,)
    )
    collector = OutputCollector(max_bytes=2 * 4 * 7)  # room for two steps of 7 floats
    with pytest.warns(RuntimeWarning, match="the oldest steps are dropped"):
        for step in steps:
            collector.add(step)
    assert len(collector) == 2 and collector.dropped_steps == 1
    mixed = collate([({"a": 1},), ({"b": 2},)])
    assert mixed == ([{"a": 1}, {"b": 2}],)  # different keys: gathered as a list

"""Integrations: tracing what ppetrace does not drive itself.

:mod:`ppetrace.integrations.dataloader` takes a PyTorch ``DataLoader`` whose
workers run in other processes (fork or spawn) and gives out their spans
(ppetrace's own and the user's ``trace()`` calls in ``__getitem__`` and
``collate_fn``) in the parent's trace, each worker on a track of its own:
the workers forward rows to the parent, whose flusher hands them to its
sinks.

:mod:`ppetrace.integrations.distributed` takes a ``torch.distributed`` process
group and gives out each rank's clock offset to rank 0 (NTP-style pings, with
an error bound), ``dist.<name>`` spans for the collectives user code calls
(with their byte counts), and one trace file per rank
(``trace.ranks/rank<R>.json``, on rank 0's clock, with ``distributedInfo``)
merged by rank 0 into one timeline.
"""

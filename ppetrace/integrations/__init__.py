"""Integrations: tracing what ppetrace does not drive itself.

:mod:`ppetrace.integrations.dataloader` takes a PyTorch ``DataLoader`` whose
workers run in other processes (fork or spawn) and gives out their spans
(ppetrace's own and the user's ``trace()`` calls in ``__getitem__`` and
``collate_fn``) in the parent's trace, each worker on a track of its own:
the workers forward rows to the parent, whose flusher hands them to its
sinks.
"""

"""Tensor parallelism inside one engine (``--tensor-parallel N``).

N ranks, one process each (rank 0 is the engine process; ranks 1..N-1 are worker processes it
starts), joined by ``torch.distributed``: NCCL for activations on CUDA, gloo on CPU, and a gloo
group for the control messages either way. Modules:

- ``group``: ``TPGroup`` (rank, world, device, the two process groups) and the collectives the
  model and the runner use; rendezvous through a TCP store on loopback.
- ``shard``: how a model is split — ``shard_args`` divides the head counts and intermediate sizes
  by N (``ValueError`` naming the numbers that do not divide), ``shard_tensor`` cuts each
  checkpoint tensor to its rank's share (column / row / vocab parallel), ``build_rank_runner``
  builds a rank's ordinary ``TorchModelRunner`` over its shard with the all-reduces after the
  row-parallel layers and the vocab-parallel embedding and LM head.
- ``worker``: the typed message codec (JSON bytes in a uint8 tensor: no pickle), ``execute`` (one
  runner call, the same code on every rank) and the rank > 0 process loop.
- ``runner``: ``TPModelRunner``, the ``runner_api.ModelRunner`` on rank 0: every call is
  broadcast and run on every rank in lockstep; spill / restore bytes of a prefix-cache entry are
  gathered to / scattered from rank 0.

Invariants: every rank runs the same calls in the same order (one lock on rank 0 orders them);
after each call the ranks agree on success (a failure anywhere raises on rank 0); the residual
stream and the logits are identical on every rank (all-reduce / all-gather results).
"""

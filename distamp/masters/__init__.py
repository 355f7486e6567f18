"""The master-weight layer: what ``optimizer.step()`` does once ``wrap`` has made it distamp's.

Where to find what (one concept per file):

- ``optimizer.py`` — the step coordinator: :class:`AmpOptimizer`, the class ``wrap`` puts in front
  of the user's optimizer class; the per-optimizer state machine, the skip (through the scaler),
  the inner optimizer's step and the masters' copy back to the model, ``state_dict``.
- ``base.py`` — the interface every kind of masters gives the step (:class:`MasterWeights`) and
  what they share on the model's side of the gradients (:class:`ModelGrads`).
- ``replicated.py`` — FP32 masters replicated on every rank (apex's O2; one rank, or
  ``shard_master_weights=False``).
- ``sharded.py`` — FP32 masters sharded across ranks (ZeRO-1): each rank holds and steps 1/N;
  ``layout.py`` says which rank owns which elements, ``gather.py`` brings the updated weights
  back to every rank after the step, ``rounds.py`` steps the shard round by round so that gather
  starts early. The reduce-scatter that fills the shards' gradients is a DDP comm hook:
  ``distamp/hooks/zero.py``.
- FSDP's sharded parameters as their own masters: ``distamp/fsdp.py`` (the public
  ``distamp.fsdp`` module).
- ``nonfinite.py`` — the inf/NaN check and unscale kernels; ``clipping.py`` — global-norm
  clipping, shared by all of the above.

The skip decision itself (one collective per step) lives in ``distamp/scaler.py``.
"""

"""Reading and writing checkpoint directories; :mod:`rlcore.trainer.checkpoint` decides *when* and *which*.

* :mod:`~rlcore.trainer.store.files`: durable writes (fsync), atomic directory replacement and
  removal through a trash name, the ``latest`` pointer;
* :mod:`~rlcore.trainer.store.manifest`: the manifest with sizes and checksums, verification;
* :mod:`~rlcore.trainer.store.state`: what each entry of the state is, writing it (at once or in
  the background) and loading it back as data only (``torch.load(weights_only=True)``);
* :mod:`~rlcore.trainer.store.export`: the Hugging Face export.

Collectives come from :mod:`rlcore.distributed.init` and are no-ops with one process.
"""

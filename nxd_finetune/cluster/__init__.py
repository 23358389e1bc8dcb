"""Cluster-facing parts: what a cluster runs to train with nxd-finetune.

- :mod:`.spec`: the node layout of a recipe, the ``torchrun`` line, accelerator resources and the
  environment the recipe implies (pure functions, no torchx / kubernetes imports).
- :mod:`.components`: the TorchX component (``torchx run nxd_finetune/cluster/components.py:finetune``;
  needs the ``torchx`` extra).
- :mod:`.k8s`: Kubeflow ``PyTorchJob`` and one-node precompile ``Job`` manifests for a recipe
  (``nxd-finetune k8s ...``, :mod:`.cli`).
- :mod:`.trainjob`: Kubeflow Trainer v2 ``TrainJob`` + torch ``ClusterTrainingRuntime``
  (``nxd-finetune k8s trainjob``).
- :mod:`.volume`: the shared volume (compile cache, recipe paths the pods cannot see).
- :mod:`.images`: the Dockerfiles under ``docker/`` (build arguments, what they install and run).

Process-group startup (the elastic launcher, ``init_distributed``) stays in
:mod:`nxd_finetune.parallel.launch`.
"""

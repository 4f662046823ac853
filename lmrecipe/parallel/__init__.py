"""How a run's processes share the work (the layer between the configuration and the run).

- ``topology``: :class:`Topology`, every parallel size and the ZeRO setup, decided once; the launch's checks of it;
- ``launch``: the process count asked of the launcher, and :func:`check_launch`, which decides the topology;
- ``deepspeed_config``: the DeepSpeed JSON with every value the recipe owns filled in;
- ``precision``: ``train.precision`` on this machine, fp8's needs;
- ``splits``: what the sequence, tensor and expert splits need of the model and do to it;
- ``accelerator``: the Accelerator built from all of them (:func:`build_runtime`).
"""

"""Parallelism applied from outside the model: process group, FSDP2, batch sharding, role placement,
launching workers (torchrun, Ray) and the hang watchdog. With one process every collective is the identity."""

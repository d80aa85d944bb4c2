"""The MindSpore scheduler process of a :class:`~hyper_parallel_ms.testing.RankPool`.

Run as ``python -m hyper_parallel_ms.testing._scheduler`` with ``MS_ROLE=MS_SCHED`` and the
cluster environment; it serves the workers' topology until the pool stops it.

Example::

    MS_ROLE=MS_SCHED MS_WORKER_NUM=4 MS_SCHED_HOST=127.0.0.1 MS_SCHED_PORT=8118 \\
        python -m hyper_parallel_ms.testing._scheduler
"""
from __future__ import annotations


def main() -> None:
    """Scheduler entry point: ``init()`` runs the scheduler until the workers leave."""
    import mindspore as ms
    from mindspore import communication

    ms.set_device("CPU")
    communication.init()


if __name__ == "__main__":
    main()

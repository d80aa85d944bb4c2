"""MindFormers' ``Trainer`` on this library, end to end: built from a config dict with the model instance and
a MindSpore dataset, parallelized by its own ``_apply_parallelism`` (TP=2 with sequence parallelism, FSDP
over dp=2 with each dp rank reading its rows, or its pipeline path over pp=2: its DeepSeek-V3, whose stages
it builds, through HyperParallel's ``Schedule1F1B`` served by ``hyper_parallel_ms.compat._schedules``), its
parameters initialised by its ``init_states`` then loaded with the test's weights, its optimizer and
learning-rate schedule built from the config, ``Trainer.train()`` for 3 steps. Module-level function for the
rank pool of tests/test_mindformers.py.

Three things of the CPU ranks' environment, each undone after the run:
- the rank pool has initialised communication and outlives the trainer: its ``init_process_group`` and
  ``destroy_process_group`` are no-ops for the run;
- MindSpore 2.10's ``Cell.to_empty()`` without a device keeps a meta tensor on the meta device (measured;
  its docstring says the current device): the trainer's ``to_empty()`` is given the context's device;
- the CPU twins (``cpu_twins``), as in every MindFormers test here."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

def train(steps: int, tensor_parallel: int, pipeline_parallel: int = 1, moe: bool = False,
          checkpoint: Optional[Dict[str, Any]] = None
          ) -> Tuple[List[float], List[float], Dict[str, np.ndarray], Dict[str, Any]]:
    """``Trainer.train()`` on the Qwen3 of tests/_mindformers_qwen3.py (``moe``: the DeepSeek-V3 of
    tests/_mindformers_moe.py) with ``tensor_parallel`` (and sequence parallelism) and ``pipeline_parallel``
    (micro-batches of one row), the rest of the world data parallel (FSDP), each dp rank reading its rows of
    the batch; returns the losses and global norms its step-end callbacks saw (a pipeline's loss on the last
    stage's rank only), this rank's full parameters, and what the trainer built."""
    from tests._mindformers_backward import MAX_NORM
    from tests._mindformers_qwen3 import BATCH, _batch, _setup, _weights, config
    _setup()
    import mindspore as ms
    import mindspore.dataset as ds
    from mindspore import nn
    from mindspore.ops.communication import set_comm_ops_inplace
    import mindformers.pynative.distributed.parallel_dims as parallel_dims
    import mindformers.pynative.trainer.trainer as trainer_module
    from mindformers.models.qwen3.modeling_qwen3_train_pynative import PyNativeQwen3ForCausalLM
    from mindformers.pynative.callback.callback import TrainerCallback
    from hyper_parallel_ms.checkpoint import StateDictOptions, get_model_state_dict, set_model_state_dict
    from hyper_parallel_ms.testing import cpu_twins
    from hyper_parallel_ms.training import disable_mindspore_backward_compat

    seen: Dict[str, List[float]] = {"loss": [], "grad_norm": []}

    class Record(TrainerCallback):
        def on_step_end(self, args, state, **kwargs):
            if kwargs["loss"] is not None:      # a pipeline's loss is on the last stage's rank only
                seen["loss"].append(float(np.asarray(kwargs["loss"].asnumpy()).reshape(-1)[0]))
            seen["grad_norm"].append(float(np.asarray(kwargs["grad_norm"].asnumpy()).reshape(-1)[0]))

    from mindspore.communication import get_group_size, get_rank
    data_parallel = get_group_size() // (tensor_parallel * pipeline_parallel)
    per_rank = BATCH // data_parallel
    local = per_rank // pipeline_parallel          # pp: this dp rank's rows in micro-batches of one row
    mine = (get_rank() // tensor_parallel) % data_parallel
    ids, labels = _batch()
    rows = [(ids[i], labels[i]) for i in range(mine * per_rank, (mine + 1) * per_rank)] * steps
    dataset = ds.GeneratorDataset(lambda: iter(rows), ["input_ids", "labels"], shuffle=False).batch(local)
    cfg = {"training": {"steps": steps, "local_batch_size": local, "global_batch_size": BATCH, "max_norm": MAX_NORM},
           "parallelism": {"tensor_parallel": tensor_parallel, "sequence_parallel": tensor_parallel > 1,
                           "pipeline_parallel": pipeline_parallel},
           "checkpoint": checkpoint or {"enable_save": False},
           "model": {"model_type": "qwen3", "architectures": "PyNativeQwen3ForCausalLM"},
           "train_dataset": {"dataloader": {"type": "GeneratorDataset"}},
           "optimizer": {"type": "AdamW", "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0},
           "lr_scheduler": {"type": "ConstantWarmUpLR", "learning_rate": 1e-2, "warmup_steps": 0}}
    saved = (trainer_module.init_process_group, trainer_module.destroy_process_group, nn.Cell.to_empty)
    to_empty = nn.Cell.to_empty

    def to_empty_on_this_device(self, *, device=None, recurse=True):
        return to_empty(self, device=device or ms.get_context("device_target"), recurse=recurse)

    parallel_dims.device_type = "cpu"
    set_comm_ops_inplace(False)
    trainer_module.init_process_group = trainer_module.destroy_process_group = lambda *a, **k: None
    nn.Cell.to_empty = to_empty_on_this_device
    try:
        with cpu_twins():
            if moe:
                from mindformers.models.deepseek3.modeling_deepseek_v3_pynative import PyNativeDeepseekV3ForCausalLM
                from tests._mindformers_moe import moe_config
                model = PyNativeDeepseekV3ForCausalLM(moe_config())
                cfg["model"] = {"model_type": "deepseek_v3", "architectures": "PyNativeDeepseekV3ForCausalLM"}
            else:
                model = PyNativeQwen3ForCausalLM(config())
            full = _weights(model)
            trainer = trainer_module.Trainer(config=cfg, model=model, train_dataset=dataset, callbacks=[Record()])
            built = {"model": [type(m).__name__ for m in trainer.model], "optimizer": type(trainer.optimizer).__name__,
                     "tensor_parallel": trainer.parallel_dims.tp, "data_parallel": trainer.config.parallelism.data_parallel}
            if trainer.schedule is not None:
                built["schedule"] = type(trainer.schedule).__name__
                built["stages"] = [type(st).__name__ for st in trainer.schedule.stages]
                built["layers"] = sorted({n.split(".")[3] for part in trainer.model
                                          for n, _ in part.parameters_and_names() if ".layers." in n})
            for part in trainer.model:          # a pipeline rank's stage holds some of the names
                names = [n for n, _ in part.parameters_and_names()]
                set_model_state_dict(part, {n: ms.Tensor(full[n]) for n in names},
                                     options=StateDictOptions(full_state_dict=True))
            trainer.train()
            state = {}
            for part in trainer.model:
                state.update({k: v.asnumpy() for k, v in get_model_state_dict(
                    part, options=StateDictOptions(full_state_dict=True)).items()})
            return seen["loss"], seen["grad_norm"], state, built
    finally:
        trainer_module.init_process_group, trainer_module.destroy_process_group, nn.Cell.to_empty = saved
        disable_mindspore_backward_compat()
        set_comm_ops_inplace(True)
        parallel_dims.device_type = "npu"


def resume(steps: int) -> Dict[str, Any]:
    """MindFormers' checkpoint callback and its resume: TP=2 + SP trained ``steps - 1`` steps and saved (model
    and AdamW states, its layouts from HyperParallel's ``get_current_layout``), then loaded into a new Trainer
    with TP=2 + SP and one with FSDP over dp=2 (the pieces resharded) that train the last step; the same for its
    DeepSeek-V3 over pp=2. Returns each resumed run's losses and full parameters (a stage's on its rank).

    MindSpore 2.10's ``mint.distributed`` object collectives (its layout gathering) default to the group
    ``"hccl_world_group"``, bound at import: on CPU ranks a group of that name over the world stands in for the
    run, and is destroyed after."""
    import os
    import shutil
    import tempfile
    from mindspore.communication import create_group, destroy_group, get_group_size, get_rank
    from mindspore.mint import distributed as dist

    path = os.path.join(tempfile.gettempdir(), f"hpms_mindformers_resume_{os.getppid()}")   # the ranks share a parent
    save = {"enable_save": True, "save_interleaved_steps": steps - 1}
    create_group("hccl_world_group", list(range(get_group_size())))
    try:
        train(steps - 1, 2, checkpoint=dict(save, save_path=os.path.join(path, "tp")))
        out = {}
        for case, tensor_parallel in (("tp2_sp", 2), ("fsdp_dp2", 1)):
            losses, _, state, _ = train(steps, tensor_parallel, checkpoint={"enable_save": False,
                                                                           "load_path": os.path.join(path, "tp")})
            out[case] = (losses, state)
        # its pipeline path (DeepSeek-V3 over pp=2): each stage's rank saves and loads its stage
        train(steps - 1, 1, pipeline_parallel=2, moe=True, checkpoint=dict(save, save_path=os.path.join(path, "pp")))
        losses, _, state, _ = train(steps, 1, pipeline_parallel=2, moe=True,
                                    checkpoint={"enable_save": False, "load_path": os.path.join(path, "pp")})
        out["pp2_moe"] = (losses, state)
        return out
    finally:
        dist.barrier()
        if get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
        destroy_group("hccl_world_group")


def four_rank_runs(steps: int) -> Dict[str, Any]:
    """On 4 ranks: its Trainer on its DeepSeek-V3 over pp=2 x tp=2 (sequence parallelism inside each stage), rank 0
    also running the trainer step on one device (the others need not wait for it); and its Muon optimizer on
    weights sharded over a 2 x 2 mesh (tests/_mindformers_muon.py)."""
    from mindspore.communication import get_rank
    from tests._mindformers_backward import one_device
    from tests._mindformers_muon import deredundancy
    out: Dict[str, Any] = {"pp2_tp2": train(steps, 2, pipeline_parallel=2, moe=True)}
    if get_rank() == 0:
        out["reference"] = one_device(steps, moe=True)
    out["muon_2d"] = deredundancy(2, (2, 2))
    return out

"""The tiny reference GPT on the synthetic addition task, as most parity tests train it: the model, the batch,
the optimizers, a plait run and the single-device reference run."""

import torch
from helpers.reference import Trajectory, snapshot_grads, snapshot_params, train_reference

import plait
from plait import Layout
from plait.data import AdditionTask, ShardedBatches
from plait.models import GPT, GPTConfig

STEPS = 5
GLOBAL_BATCH = 8
OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
}


def make_model(position: str = "learned") -> tuple[GPT, AdditionTask]:
    task = AdditionTask(digits=2, seed=1)
    torch.manual_seed(1234)
    # bias=False: the key projection's bias has an analytically zero gradient (softmax ignores a shift shared
    # by every score), so its gradient is pure rounding noise that Adam normalises to +-lr: not a parity signal.
    config = GPTConfig(
        vocab_size=task.vocab_size, seq_len=task.seq_len, n_layer=2, n_head=2, d_model=16, position=position, bias=False
    )
    return GPT(config), task


def train_plait(layout: Layout, optimizer: str, max_grad_norm: float | None = None) -> Trajectory:
    """Train with plait on this rank's share of each global batch; the trajectory as seen by this rank."""
    model, task = make_model()
    engine = plait.parallelize(model, layout, optimizer=OPTIMIZERS[optimizer], max_grad_norm=max_grad_norm)
    out = Trajectory()
    engine.before_optimizer_step.append(lambda e: out.grads.append(snapshot_grads(e.model)))
    loader = ShardedBatches(task, GLOBAL_BATCH, dp_rank=engine.mesh.index("dp"), dp_size=engine.mesh.size("dp"))
    for step, batch in zip(range(STEPS), loader):
        stats = engine.train_step(batch)
        assert stats.step == step + 1 and stats.tokens == GLOBAL_BATCH * task.seq_len
        out.losses.append(stats.loss)
        out.params.append(snapshot_params(engine.model))
    return out


def reference(optimizer: str, max_grad_norm: float | None = None) -> Trajectory:
    model, task = make_model()
    loader = ShardedBatches(task, GLOBAL_BATCH)
    batches = [loader.global_batch_at(step) for step in range(STEPS)]
    return train_reference(model, batches, OPTIMIZERS[optimizer], max_grad_norm=max_grad_norm)

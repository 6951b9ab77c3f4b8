"""The table optimizers the table tests compare with torch's: each a local torch
optimizer and the same one as the servers run it."""

from __future__ import annotations

import torch

import elasticps.torch as ept

TABLE_OPTIMIZERS = {
    "sgd": (lambda ps: torch.optim.SGD(ps, lr=0.2), ept.table_optimizer("sgd", lr=0.2)),
    "adagrad": (
        lambda ps: torch.optim.Adagrad(ps, lr=0.3, initial_accumulator_value=0.1, eps=1e-8),
        ept.table_optimizer(torch.optim.Adagrad, lr=0.3, initial_accumulator_value=0.1, eps=1e-8),
    ),
    "sparse_adam": (
        lambda ps: torch.optim.SparseAdam(ps, lr=0.05, betas=(0.8, 0.95)),
        ept.table_optimizer(torch.optim.SparseAdam, lr=0.05, betas=(0.8, 0.95)),
    ),
}

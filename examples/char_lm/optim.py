"""The example's optimizer and its learning-rate schedule."""

import math

import torch


def set_learning_rate(optimizer, args, step):
    """Set and return step ``step``'s learning rate: linear warm-up over the first 5 % of the
    steps, then cosine decay to lr/10."""
    warmup = max(1, args.steps // 20)
    lr = args.lr * min(1.0, (step + 1) / warmup)
    lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / args.steps)))
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def make_optimizer(args, params):
    """``--optimizer``: AdamW (weight decay 0.1) or SGD (momentum 0.9), at ``--lr``."""
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1)

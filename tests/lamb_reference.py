"""A plain-torch LAMB, one tensor at a time, written from the paper (You et al. 2019, Algorithm 2) and DeepSpeed
0.19.8's FusedLamb kernel (csrc/lamb/fused_lamb_cuda_kernel.cu: lamb_cuda_kernel_part1/part3 and
fused_lamb_cuda), the reference the engine's `optimizer.type: "Lamb"` is tested against.

Per tensor: the moments without bias correction; update = m / (sqrt(v) + eps) + weight_decay * w; the trust
ratio ||w|| / ||update|| clamped to [min_coeff, max_coeff] (1 where either norm is 0); step size
lr * sqrt(1 - beta2^t) / (1 - beta1^t) with bias correction, else lr; w -= step_size * ratio * update.
"""
from __future__ import annotations

import math

import torch


class ReferenceLamb:
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, bias_correction=True,
                 max_coeff=10.0, min_coeff=0.01, eps_inside_sqrt=False):
        self.params = list(params)
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.bias_correction, self.max_coeff, self.min_coeff = bias_correction, max_coeff, min_coeff
        self.eps_inside_sqrt = eps_inside_sqrt
        self.t = 0
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.raw_ratios: list[float] = []        # before the clamp, last step

    @torch.no_grad()
    def step(self):
        self.t += 1
        b1, b2 = self.betas
        scale = math.sqrt(1 - b2 ** self.t) / (1 - b1 ** self.t) if self.bias_correction else 1.0
        self.raw_ratios = []
        for w, m, v in zip(self.params, self.m, self.v):
            if w.grad is None:
                continue
            g = w.grad
            m.copy_(b1 * m + (1 - b1) * g)
            v.copy_(b2 * v + (1 - b2) * g * g)
            denom = torch.sqrt(v + self.eps) if self.eps_inside_sqrt else torch.sqrt(v) + self.eps
            update = m / denom + self.wd * w
            w_norm, u_norm = w.norm().item(), update.norm().item()
            ratio = 1.0
            if w_norm != 0 and u_norm != 0:
                self.raw_ratios.append(w_norm / u_norm)
                ratio = min(max(w_norm / u_norm, self.min_coeff), self.max_coeff)
            w.sub_(self.lr * scale * ratio * update)

    def zero_grad(self):
        for w in self.params:
            w.grad = None

"""What bf16 autocast changes in a trained image policy: the same weights in fp32 and in bf16.

    PYTHONPATH=src python benchmarks/bf16_drift.py runs/pong_appo-seed1          # last.pt
    PYTHONPATH=src python benchmarks/bf16_drift.py runs/pong_appo-seed1 --which best

Loads a run's checkpoint into an fp32 and a bf16 model (a plain env with a CNN torso), plays
``--frames`` steps with the fp32 policy and prints, on the frames it visited:

- the log-probability of the sampled actions, bf16 against fp32, and how often the greedy
  action differs;
- bf16's importance ratio between an actor's forward (``--columns`` frames a step) and the
  learner's (the whole ``[T, B]`` batch) of the same weights: the off-policy noise bf16 adds;
- per torso layer, the part of the activations that varies between frames, and bf16's error
  as a share of that part (the static screen dominates an untrained CNN's activations);
- the gradient of a policy, value and entropy loss (made-up advantages and targets), bf16
  against fp32: cosine and relative error, per weight; and, for scale, fp32's gradients on two
  halves of the frames.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import torch
from torch import Tensor, nn

from impala_rl.nn.factory import build_model
from impala_rl.policy import load_policy


def visited_frames(env_factory, model: nn.Module, n: int, seed: int = 0) -> Tensor:
    """``[n, *obs]``: the observations ``model``'s policy sees when it plays ``n`` steps."""
    env = env_factory()
    obs, _ = env.reset(seed=seed)
    frames = []
    with torch.no_grad():
        while len(frames) < n:
            frames.append(np.asarray(obs))
            action = int(model.policy(0, torch.as_tensor(frames[-1])[None]).sample()[0])
            obs, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                obs, _ = env.reset()
    env.close()
    return torch.as_tensor(np.stack(frames))


def loss_gradient(model: nn.Module, x: Tensor, actions: Tensor, adv: Tensor, target: Tensor):
    """``{name: grad}`` of a policy-gradient, value and entropy loss on frames ``x [N, *obs]``."""
    model.zero_grad()
    dist, value = model.policy_value(0, x)
    pg = -(dist.log_prob(actions) * adv).mean()
    loss = pg + 0.5 * ((value - target) ** 2).mean() - 0.01 * dist.entropy().mean()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _flat(grads: dict[str, Tensor]) -> Tensor:
    return torch.cat([g.flatten() for g in grads.values()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--which", default="last", choices=["last", "best"])
    parser.add_argument("--frames", type=int, default=1280)
    parser.add_argument("--columns", type=int, default=16, help="B: frames per acting step")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)  # the sampled actions, so a checkpoint's figures repeat
    policy = load_policy(args.run_dir, args.which)
    env = policy.env_factory()
    # both precisions built here, so that a bf16 run's checkpoint compares as an fp32 one's
    fp32, bf16 = (
        build_model(
            dataclasses.replace(policy.config.model, precision=p),
            env.observation_space,
            env.action_space,
        ).eval()
        for p in ("fp32", "bf16")
    )
    env.close()
    fp32.load_state_dict(policy.model.state_dict())
    bf16.load_state_dict(policy.model.state_dict())
    x = visited_frames(policy.env_factory, fp32, args.frames)
    B = args.columns
    T = len(x) // B
    x = x[: T * B]
    outputs: dict[str, list[Tensor]] = {"fp32": [], "bf16": []}
    hooks = [  # each torso layer's output, on the forward below
        layer.register_forward_hook(lambda m, i, out, k=key: outputs[k].append(out.float()))
        for key, model in (("fp32", fp32), ("bf16", bf16))
        for layer in model.policies["0"].torso.modules()
        if isinstance(layer, (nn.Conv2d, nn.Linear))
    ]
    with torch.no_grad():
        d32, d16 = fp32.policy(0, x), bf16.policy(0, x)
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        actions = d32.sample()
        drift = d16.log_prob(actions) - d32.log_prob(actions)
        greedy = (d32.logits.argmax(-1) != d16.logits.argmax(-1)).float().mean()
        xt, at = x.reshape(T, B, *x.shape[1:]), actions.reshape(T, B)
        learner = bf16.policy(0, xt).log_prob(at)
        actor = torch.stack([bf16.policy(0, xt[t]).log_prob(at[t]) for t in range(T)])
    print(f"{args.run_dir} ({args.which}), {len(x)} frames the fp32 policy visited")
    print(
        f"entropy {d32.entropy().mean():.3f} nats; log-prob bf16 - fp32: std {drift.std():.4f}; "
        f"greedy action differs on {greedy:.2%} of frames"
    )
    print(
        f"bf16 log ratio, learner [T, B] against actor [B]: std {(learner - actor).std():.2e}, "
        f"max {(learner - actor).abs().max():.2e}"
    )
    for i, (a, b) in enumerate(zip(outputs["fp32"], outputs["bf16"], strict=True)):
        A, D = a.flatten(1), (b - a).flatten(1)
        varies = (A - A.mean(0)).norm() / A.norm()
        share = (D - D.mean(0)).norm() / (A - A.mean(0)).norm()
        print(
            f"  torso layer {i + 1}: {varies:.1%} of the activations vary between frames; "
            f"bf16's error {share:.2%} of that part"
        )
    g = torch.Generator().manual_seed(0)
    adv, target = torch.randn(len(x), generator=g), torch.randn(len(x), generator=g)
    half = len(x) // 2
    g32 = loss_gradient(fp32, x[:half], actions[:half], adv[:half], target[:half])
    g16 = loss_gradient(bf16, x[:half], actions[:half], adv[:half], target[:half])
    f32, f16 = _flat(g32), _flat({n: g16[n] for n in g32})
    cosine = torch.nn.functional.cosine_similarity(f32, f16, dim=0)
    print(
        f"gradient, bf16 against fp32: cosine {cosine:.5f}, relative error "
        f"{(f16 - f32).norm() / f32.norm():.2%}"
    )
    for name in g32:
        if name.endswith("weight"):
            err = (g16[name] - g32[name]).norm() / g32[name].norm()
            print(f"  {name}: {err:.2%}")
    q = len(x) // 4
    h1 = _flat(loss_gradient(fp32, x[:q], actions[:q], adv[:q], target[:q]))
    h2 = _flat(loss_gradient(fp32, x[q:half], actions[q:half], adv[q:half], target[q:half]))
    apart = (h1 - h2).norm() / (h1 + h2).mul(0.5).norm()
    print(f"for scale, fp32 on two halves of those frames: {apart:.0%} apart")


if __name__ == "__main__":
    main()

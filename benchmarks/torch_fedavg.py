"""The PyTorch baseline of the benchmarks: one FedAvg round as a client-after-client loop (the loop a
PyTorch simulator runs), shared by ``throughput.py`` and ``time_to_accuracy.py``."""
from __future__ import annotations


def torch_fedavg_round(model, global_state: dict, clients, ids, lr: float, batch: int, epochs: int = 1,
                       generator=None) -> dict:
    """The new global state after one FedAvg round: each client in ``ids`` (``clients[i]`` = (x, y) tensors)
    loads ``global_state``, runs ``epochs`` epochs of plain SGD on minibatches of ``batch`` in a fresh random
    order, and the states are averaged weighted by sample count. ``generator(i)``: client i's
    ``torch.Generator`` for its order (None: torch's global one)."""
    import torch
    import torch.nn.functional as F
    acc = {k: torch.zeros_like(v) for k, v in global_state.items()}
    total = 0
    for i in ids:
        x, y = clients[int(i)]
        n = len(y)
        model.load_state_dict(global_state)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        gen = generator(int(i)) if generator is not None else None
        for _ in range(epochs):
            perm = (torch.randperm(n, generator=gen, device=gen.device) if gen is not None
                    else torch.randperm(n, device=y.device))
            for s in range(0, n, batch):
                idx = perm[s:s + batch]
                opt.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
        with torch.no_grad():
            for k, v in model.state_dict().items():
                acc[k].add_(v, alpha=float(n))
        total += n
    return {k: v / total for k, v in acc.items()}


def torch_vmap_fedavg_round(model, global_params: dict, x, y, counts, lr: float, batch: int, epochs: int = 1,
                            generator=None) -> dict:
    """The new global parameters after one FedAvg round, the cohort vectorized as a PyTorch user writes it
    (``torch.func``): every client's parameters stacked [k, ...], ``vmap(grad(loss))`` over the cohort padded to
    its longest client, each step's batch masked to the client's real samples and a finished client's update
    masked out; plain SGD; the states averaged weighted by sample count. Everything stays on the device: the
    per-epoch orders are drawn there (``torch.rand`` priorities, the real samples first) and no step syncs.

    x [k, M, ...], y [k, M] (padding after each client's ``counts`` [k] real samples), on one device; a model
    without buffers (no BatchNorm). Every lane runs ceil(max(counts) / B) steps an epoch: the padded work."""
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call, grad, vmap

    k, m = y.shape[0], y.shape[1]
    counts = counts.to(y.device)
    params = {name: p.detach().unsqueeze(0).expand((k,) + p.shape).clone() for name, p in global_params.items()}

    def loss(p, xb, yb, w):
        out = functional_call(model, p, (xb,))
        return (F.cross_entropy(out, yb, reduction="none") * w).sum() / w.sum().clamp(min=1.0)

    step_grads = vmap(grad(loss))
    steps = (counts + batch - 1) // batch
    n_steps = int(-(-m // batch))
    pos = torch.arange(m, device=y.device)
    lanes = torch.arange(k, device=y.device)[:, None]
    for _ in range(epochs):
        prio = torch.rand((k, m), device=y.device, generator=generator)
        order = torch.argsort(torch.where(pos[None] < counts[:, None], prio, 2.0), dim=1)
        order = torch.nn.functional.pad(order, (0, n_steps * batch - m))
        for t in range(n_steps):
            idx = order[:, t * batch:(t + 1) * batch]
            w = ((t * batch + torch.arange(batch, device=y.device))[None] < counts[:, None]).float()
            g = step_grads(params, x[lanes, idx], y[lanes, idx], w)
            active = (t < steps).float()
            for name in params:
                params[name].sub_(lr * g[name] * active.view((k,) + (1,) * (g[name].dim() - 1)))
    weights = counts.float() / counts.sum()
    return {name: torch.tensordot(weights, p, dims=1) for name, p in params.items()}

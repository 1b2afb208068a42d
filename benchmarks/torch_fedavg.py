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

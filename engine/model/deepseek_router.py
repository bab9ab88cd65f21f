"""DeepSeek V3's router (transformers' DeepseekV3TopkRouter), in fp32: sigmoid scores; each
group of experts ranks by the sum of its best two (score + e_score_correction_bias), the best
`topk_group` groups stay; the top k of their experts by score + bias are chosen, weighted by
their plain scores (renormalised with `norm_topk_prob`) times `routed_scaling_factor`."""

import torch
import torch.nn.functional as F


def route_grouped(
    h: torch.Tensor,
    router: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    groups: tuple[int, int],
    renormalise: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in h's dtype, expert ids [T, k]) of h [T, H] through router [E, H]."""
    num_groups, keep_groups = groups
    scores = F.linear(h.float(), router.float()).sigmoid()
    choice = scores + correction_bias.float()
    per_group = choice.view(h.shape[0], num_groups, -1)
    group_scores = per_group.topk(2, dim=-1)[0].sum(dim=-1)
    kept = torch.topk(group_scores, k=keep_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, kept, 1.0).bool()
    expert_mask = group_mask.unsqueeze(-1).expand_as(per_group).reshape_as(choice)
    choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * scaling).to(h.dtype), ids


def route_softmax_grouped(
    h: torch.Tensor, router: torch.Tensor, top_k: int, groups: tuple[int, int], scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek V2's (transformers' DeepseekV2TopkRouter): a softmax over every expert in
    fp32; the `topk_group` groups with the best single score kept (one group of one: its
    "greedy"), the top k of their scores, times `scaling`, not renormalised."""
    num_groups, keep_groups = groups
    scores = F.linear(h.float(), router.float()).softmax(dim=-1)
    per_group = scores.view(h.shape[0], num_groups, -1)
    kept = torch.topk(per_group.max(dim=-1).values, k=keep_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(per_group[..., 0]).scatter_(1, kept, 1.0).bool()
    expert_mask = group_mask.unsqueeze(-1).expand_as(per_group).reshape_as(scores)
    weights, ids = torch.topk(scores.masked_fill(~expert_mask, 0.0), k=top_k, dim=-1, sorted=False)
    return (weights * scaling).to(h.dtype), ids

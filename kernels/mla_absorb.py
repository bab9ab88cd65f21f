"""The torch halves of the absorbed latent attention kernels (kernels/mla_attention.py in
Triton, kernels/cpu_mla.py in C): W_UK absorbed into the query before the kernel, W_UV
applied after it. The kernels attend over whole latent page rows [latent | rope key] (K and V
planes, each with its own fp8 scale); these turn their rows into what the torch twin,
kernels/reference_mla.py's mla_paged_attention_ref, returns.
"""

import torch


def absorbed_query(
    q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor, half: int, scales=(1.0, 1.0)
) -> torch.Tensor:
    """fp32 [T, H, 2 * half]: [q_nope . W_UK | q_pe] per head (W_UK absorbed), each half
    times its plane's fp8 scale. q_nope [T, H, n], q_pe [T, H, r], w_uk [H, n, L]."""
    q_latent = torch.einsum("thn,hnl->thl", q_nope.float(), w_uk.float())
    query = torch.cat((q_latent, q_pe.float()), dim=-1)
    assert query.shape[-1] == 2 * half, f"row {query.shape[-1]} is not two planes of {half}"
    query[..., :half] *= scales[0]
    query[..., half:] *= scales[1]
    return query.contiguous()


def latent_output(rows: torch.Tensor, w_uv: torch.Tensor, scales=(1.0, 1.0)) -> torch.Tensor:
    """Attended rows fp32 [T, H, 2 * half] (stored values) -> fp32 [T, H, v]: each half times
    its plane's scale, the latent columns kept, W_UV [H, v, L] applied."""
    half = rows.shape[-1] // 2
    rows[..., :half] *= scales[0]
    rows[..., half:] *= scales[1]
    return torch.einsum("thl,hvl->thv", rows[..., : w_uv.shape[-1]], w_uv.float())

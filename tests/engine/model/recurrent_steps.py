"""Drives a recurrent mixer (Mamba2, gated DeltaNet: same calling convention) the way the
engine's steps do: each step one batch of every unfinished sequence, a prompt in prefill chunks
of `chunk` tokens, then one token a step, each sequence in its own state slot."""

import torch


def run_in_steps(mixer, seqs, slots, prompt_lens, states, chunk: int = 3) -> list[torch.Tensor]:
    """Each sequence's outputs [len, hidden], put together from the steps."""
    lengths = [seq.shape[0] for seq in seqs]
    done, outputs = [0] * len(seqs), [[] for _ in seqs]
    while any(d < n for d, n in zip(done, lengths)):
        batch, lens, owners = [], [], []
        for i, seq in enumerate(seqs):
            if done[i] >= lengths[i]:
                continue
            take = min(chunk, prompt_lens[i] - done[i]) if done[i] < prompt_lens[i] else 1
            batch.append(seq[done[i] : done[i] + take])
            lens.append(take)
            owners.append(i)
        batch_slots = [slots[i] for i in owners]
        out = mixer(torch.cat(batch), lens, batch_slots, states.conv[0], states.ssm[0])
        for piece, i, n in zip(out.split(lens), owners, lens):
            outputs[i].append(piece)
            done[i] += n
    return [torch.cat(pieces) for pieces in outputs]

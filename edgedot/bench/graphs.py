"""Random edge lists for the benchmark, generated on the target device with vectorised torch ops."""

import torch

# Graph500 R-MAT quadrant probabilities (d = 1 - a - b - c = 0.05).
RMAT_A, RMAT_B, RMAT_C = 0.57, 0.19, 0.19


def uniform_edges(num_src, num_dst, num_edges, generator):
    """``num_edges`` independent uniform (src, dst) pairs, int64, in random order."""
    device = generator.device
    src = torch.randint(num_src, (num_edges,), generator=generator, device=device)
    dst = torch.randint(num_dst, (num_edges,), generator=generator, device=device)
    return src, dst


def sorted_by_src(src, dst):
    """The same edges ordered by source row (stable, so each row keeps its random dst order)."""
    src, order = torch.sort(src, stable=True)
    return src, dst[order]


def rmat_edges(scale, num_edges, generator):
    """Power-law R-MAT graph on ``2**scale`` nodes with Graph500's parameters, int64.

    Each of the ``scale`` levels picks one quadrant per edge (one bit of src and of dst) for all
    edges at once. Node ids are then relabelled by a random permutation, as Graph500 does, so the
    hot rows are scattered. The edges are independent draws, so their order is already random.
    """
    device = generator.device
    src = torch.zeros(num_edges, dtype=torch.int64, device=device)
    dst = torch.zeros(num_edges, dtype=torch.int64, device=device)
    for level in range(scale):
        u = torch.rand(num_edges, generator=generator, device=device)
        src_bit = u >= RMAT_A + RMAT_B                                    # quadrants c, d
        dst_bit = ((u >= RMAT_A) & (u < RMAT_A + RMAT_B)) | (u >= RMAT_A + RMAT_B + RMAT_C)  # b, d
        src |= src_bit.long() << level
        dst |= dst_bit.long() << level
    relabel = torch.randperm(1 << scale, generator=generator, device=device)
    return relabel[src], relabel[dst]

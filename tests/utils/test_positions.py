"""position_ids_from_mask against a per-token reference loop, for every mask dtype and padding side."""

import pytest
import torch

from verl.utils.positions import position_ids_from_mask


def _reference(mask: list[list[float]]) -> list[list[int]]:
    out = []
    for row in mask:
        seen, positions = 0, []
        for m in row:
            positions.append(seen if m else 0)
            seen += 1 if m else 0
        out.append(positions)
    return out


MASKS = [
    [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]],  # left padding
    [[1, 1, 1, 0, 0], [0, 1, 1, 1, 0]],  # right padding, and prompt + response with both
    [[0, 0, 0, 0, 0], [0, 1, 0, 1, 1]],  # an empty row, a hole
]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.long, torch.int32, torch.bool])
def test_matches_reference_for_every_mask_dtype(mask, dtype):
    got = position_ids_from_mask(torch.tensor(mask).to(dtype))
    assert got.dtype == torch.long
    assert got.tolist() == _reference(mask)


def test_left_padding_gives_the_unpadded_positions():
    padded = position_ids_from_mask(torch.tensor([[0, 0, 1, 1, 1]]))
    plain = position_ids_from_mask(torch.ones(1, 3))
    assert torch.equal(padded[:, 2:], plain)


def test_leading_dimensions_are_kept():
    mask = torch.tensor(MASKS[0] * 3, dtype=torch.float32).reshape(3, 2, 5)
    assert position_ids_from_mask(mask).shape == (3, 2, 5)

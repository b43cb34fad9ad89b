"""A row's images through a forward: the extra inputs every stage passes give the model's own logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl.errors import DataError
from verl.models.hf_loader import load_hf_model
from verl.models.tiny_vl import build_tiny_vl_model
from verl.models.vision import batch_processor_inputs
from verl.models.vision_inputs import RowImages, has_images, image_forward_inputs, rows_of

PIL = pytest.importorskip("PIL.Image")


def image(size: int, seed: int):
    return PIL.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def vl():
    return load_hf_model(build_tiny_vl_model(), torch_dtype="fp32", device="cpu", for_training=False,
                         return_processor=True)


def test_rows_keep_their_own_images_and_the_forward_equals_the_models_own(vl):
    model, _, processor = vl
    images = [[image(56, 0)], [], [image(28, 1), image(64, 2)]]
    inputs = batch_processor_inputs(processor, images, ["<image>How many?", "2+2?", "<image> or <image>?"])
    rows = rows_of(inputs, [len(r) for r in images])
    assert rows[1] is None and rows[0].count == 1 and rows[2].count == 2
    assert sum(r.pixel_values.shape[0] for r in rows if r) == inputs["pixel_values"].shape[0]
    extra = image_forward_inputs(model, inputs["input_ids"], inputs["attention_mask"], rows)
    assert extra["position_ids"].shape == (3, *inputs["input_ids"].shape)
    mask = inputs["attention_mask"].bool()
    with torch.no_grad():
        ours = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], **extra).logits
        theirs = model(**inputs).logits  # transformers' own positions (from mm_token_type_ids)
        # the first row alone, with its own images: selecting rows carries their pixels along
        alone = image_forward_inputs(model, inputs["input_ids"][:1], inputs["attention_mask"][:1], rows[:1])
        first = model(input_ids=inputs["input_ids"][:1], attention_mask=inputs["attention_mask"][:1], **alone).logits
    assert torch.allclose(ours[mask], theirs[mask], atol=1e-5)
    assert torch.allclose(first[0][mask[0]], ours[0][mask[0]], atol=1e-5)


def test_text_rows_need_no_extra_inputs_and_a_row_count_mismatch_is_refused(vl):
    model = vl[0]
    ids, mask = torch.ones(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long)
    assert image_forward_inputs(model, ids, mask, [None, None]) == {} and not has_images(None)
    one = RowImages(torch.zeros(4, 1176), torch.tensor([[1, 2, 2]]))
    with pytest.raises(DataError, match="1 rows of images for a batch of 2"):
        image_forward_inputs(model, ids, mask, [one])

"""Vision models: torchvision resnet18, timm ViT, a U-Net-style decoder with ConvTranspose,
trained 3 AdamW steps on remote_accel against CPU; and detection post-processing with
torchvision's own ops (nms, batched_nms, roi_align), which run on the server."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import model_check

torchvision = pytest.importorskip("torchvision")
timm = pytest.importorskip("timm")

R = model_check.R
STEPS = model_check.STEPS


def _images(channels: int = 3, size: int = 32, classes: int = 10, batch: int = 4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, channels, size, size, generator=g), torch.randint(0, classes, (batch,), generator=g))
            for _ in range(STEPS)]


def _classify(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def test_torchvision_resnet18(remote):
    model_check.check_training(lambda: torchvision.models.resnet18(num_classes=10), _images(), _classify)


def test_timm_vit(remote):
    def make():
        return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                                 embed_dim=32, num_heads=2, num_classes=10)

    model_check.check_training(make, _images(), _classify)


class UNetDecoder(nn.Module):
    """Encoder, then a decoder that upsamples with ConvTranspose2d (bias, in != out channels,
    and a grouped one) and joins the skip connection, as U-Nets do."""

    def __init__(self):
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.down2 = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU())
        self.bottom = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(16, 8, kernel_size=2, stride=2)
        self.up_grouped = nn.ConvTranspose2d(16, 8, kernel_size=3, padding=1, groups=2)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        skip = self.down1(x)
        h = self.bottom(self.down2(skip))
        h = torch.cat([self.up(h), skip], dim=1)
        return self.head(F.relu(self.up_grouped(h)))


def test_unet_decoder_with_conv_transpose(remote):
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(2, 3, 16, 16, generator=g), torch.randint(0, 2, (2, 16, 16), generator=g))
               for _ in range(STEPS)]
    model_check.check_training(UNetDecoder, batches, _classify)


def _detections(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * 48
    boxes = torch.cat([xy, xy + 4 + torch.rand(n, 2, generator=g) * 16], dim=1)
    return boxes, torch.rand(n, generator=g), torch.randint(0, 4, (n,), generator=g)


@pytest.mark.parametrize("n", [60, 1200])  # batched_nms takes another path above 1000 boxes on CPU
def test_detection_post_processing(remote, n):
    boxes, scores, labels = _detections(n, seed=n)
    rb, rs, rl = boxes.to(R), scores.to(R), labels.to(R)
    keep = torchvision.ops.nms(rb, rs, 0.5)
    assert keep.device.type == R
    torch.testing.assert_close(keep.cpu(), torchvision.ops.nms(boxes, scores, 0.5), rtol=0, atol=0)
    # what a detector's post-processing does: threshold, per-class NMS, top-k
    expected_keep = torchvision.ops.batched_nms(boxes, scores, labels, 0.5)
    keep = torchvision.ops.batched_nms(rb, rs, rl, 0.5)
    torch.testing.assert_close(keep.cpu(), expected_keep, rtol=0, atol=0)
    top = keep[:10]
    torch.testing.assert_close(rb[top].cpu(), boxes[expected_keep[:10]], rtol=0, atol=0)
    assert len(expected_keep) > 1


def test_roi_align_forward_and_backward(remote):
    """A second-stage head on RoI features: roi_align and its backward (torchvision's own
    autograd kernel) on the server, then a trained linear layer."""
    torch.manual_seed(3)
    features = torch.randn(2, 8, 16, 16)
    boxes, _, _ = _detections(12, seed=5)
    rois = [boxes[:7] / 4, boxes[7:] / 4]  # per-image boxes on a stride-4 feature map
    head = nn.Linear(8 * 3 * 3, 5)

    def run(device):
        f = features.to(device).requires_grad_()
        h = model_check.copy.deepcopy(head).to(device)
        pooled = torchvision.ops.roi_align(f, [r.to(device) for r in rois], output_size=(3, 3), spatial_scale=1.0,
                                           sampling_ratio=2, aligned=True)
        out = h(pooled.flatten(1))
        out.square().mean().backward()
        return pooled.detach().cpu(), f.grad.cpu(), h.weight.grad.cpu()

    for remote_value, local_value in zip(run(R), run("cpu")):
        torch.testing.assert_close(remote_value, local_value, rtol=1e-5, atol=1e-6)

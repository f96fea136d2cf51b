"""pytorch-fid's FID InceptionV3 (`InceptionV3([3])`) in Paddle, [-1, 1] NCHW images -> [B, 2048] pool features:
torchvision's Inception3 with average pools that do not count padded zeros and a last InceptionE that max-pools.
Parameter names are torchvision's, so weights convert by renaming (scripts/convert_inception_weights.py)."""

from __future__ import annotations

import os

import paddle
import paddle.nn as nn
import paddle.nn.functional as F


def basic_conv2d(in_channels: int, out_channels: int, **conv_kwargs) -> nn.Sequential:
    """Conv (no bias) -> BatchNorm -> ReLU, torchvision's Inception unit (its BasicConv2d's `conv` and `bn`)."""
    conv = nn.Conv2D(in_channels, out_channels, bias_attr=False, **conv_kwargs)
    bn = nn.BatchNorm2D(out_channels, epsilon=0.001)  # torchvision's / TensorFlow's, not Paddle's 1e-5
    return nn.Sequential(("conv", conv), ("bn", bn), ("relu", nn.ReLU()))


def _avg_pool_without_padding(x: paddle.Tensor) -> paddle.Tensor:
    return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, exclusive=True)


class FIDInceptionA(nn.Layer):
    def __init__(self, in_channels: int, pool_features: int) -> None:
        super().__init__()
        self.branch1x1 = basic_conv2d(in_channels, 64, kernel_size=1)
        self.branch5x5_1 = basic_conv2d(in_channels, 48, kernel_size=1)
        self.branch5x5_2 = basic_conv2d(48, 64, kernel_size=5, padding=2)
        self.branch3x3dbl_1 = basic_conv2d(in_channels, 64, kernel_size=1)
        self.branch3x3dbl_2 = basic_conv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = basic_conv2d(96, 96, kernel_size=3, padding=1)
        self.branch_pool = basic_conv2d(in_channels, pool_features, kernel_size=1)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        branch5x5 = self.branch5x5_2(self.branch5x5_1(x))
        branch3x3dbl = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        branch_pool = self.branch_pool(_avg_pool_without_padding(x))
        return paddle.concat([self.branch1x1(x), branch5x5, branch3x3dbl, branch_pool], axis=1)


class InceptionB(nn.Layer):  # grid reduction 35 -> 17
    def __init__(self, in_channels: int) -> None:
        super().__init__()
        self.branch3x3 = basic_conv2d(in_channels, 384, kernel_size=3, stride=2)
        self.branch3x3dbl_1 = basic_conv2d(in_channels, 64, kernel_size=1)
        self.branch3x3dbl_2 = basic_conv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = basic_conv2d(96, 96, kernel_size=3, stride=2)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        branch3x3dbl = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        branch_pool = F.max_pool2d(x, kernel_size=3, stride=2)
        return paddle.concat([self.branch3x3(x), branch3x3dbl, branch_pool], axis=1)


class FIDInceptionC(nn.Layer):
    def __init__(self, in_channels: int, channels_7x7: int) -> None:
        super().__init__()
        c7 = channels_7x7
        self.branch1x1 = basic_conv2d(in_channels, 192, kernel_size=1)
        self.branch7x7_1 = basic_conv2d(in_channels, c7, kernel_size=1)
        self.branch7x7_2 = basic_conv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7_3 = basic_conv2d(c7, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = basic_conv2d(in_channels, c7, kernel_size=1)
        self.branch7x7dbl_2 = basic_conv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = basic_conv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = basic_conv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = basic_conv2d(c7, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch_pool = basic_conv2d(in_channels, 192, kernel_size=1)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        branch7x7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        branch7x7dbl = self.branch7x7dbl_3(self.branch7x7dbl_2(self.branch7x7dbl_1(x)))
        branch7x7dbl = self.branch7x7dbl_5(self.branch7x7dbl_4(branch7x7dbl))
        branch_pool = self.branch_pool(_avg_pool_without_padding(x))
        return paddle.concat([self.branch1x1(x), branch7x7, branch7x7dbl, branch_pool], axis=1)


class InceptionD(nn.Layer):  # grid reduction 17 -> 8
    def __init__(self, in_channels: int) -> None:
        super().__init__()
        self.branch3x3_1 = basic_conv2d(in_channels, 192, kernel_size=1)
        self.branch3x3_2 = basic_conv2d(192, 320, kernel_size=3, stride=2)
        self.branch7x7x3_1 = basic_conv2d(in_channels, 192, kernel_size=1)
        self.branch7x7x3_2 = basic_conv2d(192, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7x3_3 = basic_conv2d(192, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7x3_4 = basic_conv2d(192, 192, kernel_size=3, stride=2)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        branch3x3 = self.branch3x3_2(self.branch3x3_1(x))
        branch7x7x3 = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        branch_pool = F.max_pool2d(x, kernel_size=3, stride=2)
        return paddle.concat([branch3x3, branch7x7x3, branch_pool], axis=1)


class FIDInceptionE(nn.Layer):  # max_pool: the FID graph's last block (Mixed_7c)
    def __init__(self, in_channels: int, max_pool: bool) -> None:
        super().__init__()
        self.max_pool = max_pool
        self.branch1x1 = basic_conv2d(in_channels, 320, kernel_size=1)
        self.branch3x3_1 = basic_conv2d(in_channels, 384, kernel_size=1)
        self.branch3x3_2a = basic_conv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3_2b = basic_conv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = basic_conv2d(in_channels, 448, kernel_size=1)
        self.branch3x3dbl_2 = basic_conv2d(448, 384, kernel_size=3, padding=1)
        self.branch3x3dbl_3a = basic_conv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = basic_conv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch_pool = basic_conv2d(in_channels, 192, kernel_size=1)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        branch3x3 = self.branch3x3_1(x)
        branch3x3 = paddle.concat([self.branch3x3_2a(branch3x3), self.branch3x3_2b(branch3x3)], 1)
        branch3x3dbl = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        branch3x3dbl = paddle.concat([self.branch3x3dbl_3a(branch3x3dbl), self.branch3x3dbl_3b(branch3x3dbl)], axis=1)
        pooled = F.max_pool2d(x, kernel_size=3, stride=1, padding=1) if self.max_pool else _avg_pool_without_padding(x)
        return paddle.concat([self.branch1x1(x), branch3x3, branch3x3dbl, self.branch_pool(pooled)], axis=1)


class FIDInceptionV3(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.Conv2d_1a_3x3 = basic_conv2d(3, 32, kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = basic_conv2d(32, 32, kernel_size=3)
        self.Conv2d_2b_3x3 = basic_conv2d(32, 64, kernel_size=3, padding=1)
        self.Conv2d_3b_1x1 = basic_conv2d(64, 80, kernel_size=1)
        self.Conv2d_4a_3x3 = basic_conv2d(80, 192, kernel_size=3)
        self.Mixed_5b = FIDInceptionA(192, pool_features=32)
        self.Mixed_5c = FIDInceptionA(256, pool_features=64)
        self.Mixed_5d = FIDInceptionA(288, pool_features=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = FIDInceptionC(768, channels_7x7=128)
        self.Mixed_6c = FIDInceptionC(768, channels_7x7=160)
        self.Mixed_6d = FIDInceptionC(768, channels_7x7=160)
        self.Mixed_6e = FIDInceptionC(768, channels_7x7=192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = FIDInceptionE(1280, max_pool=False)
        self.Mixed_7c = FIDInceptionE(2048, max_pool=True)

    def forward(self, images: paddle.Tensor) -> paddle.Tensor:
        # pytorch-fid's resize to 299 px (bilinear, no antialiasing); its [0, 1] -> [-1, 1] step commutes with it
        x = F.interpolate(images.astype("float32"), size=[299, 299], mode="bilinear", align_corners=False)
        for name, block in self.named_children():  # in the order built above, a max-pool after 2b and 4a
            x = block(x)
            if name in ("Conv2d_2b_3x3", "Conv2d_4a_3x3"):
                x = F.max_pool2d(x, kernel_size=3, stride=2)
        return F.adaptive_avg_pool2d(x, output_size=1).flatten(start_axis=1)


def load_fid_inception(weights_path: str | os.PathLike) -> FIDInceptionV3:
    """`FIDInceptionV3` in eval mode, frozen, from a converted .pdparams file; a missing, unexpected or misshapen
    tensor is an error (a wrong file must not give meaningless FIDs silently)."""
    model, state = FIDInceptionV3(), paddle.load(str(weights_path))
    misshapen = [f"{name} has shape {list(state[name].shape)}, expected {list(tensor.shape)}"
                 for name, tensor in model.state_dict().items()
                 if name in state and list(state[name].shape) != list(tensor.shape)]
    missing, unexpected = model.set_state_dict(state)
    if missing or unexpected or misshapen:
        raise ValueError(f"{weights_path}: {'; '.join(misshapen[:3])} missing keys {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for parameter in model.parameters():
        parameter.stop_gradient = True
    model.eval()
    return model

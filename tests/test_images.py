"""Tests of vae_trainer.data.images: base64 tolerance, mode conversions, size limits, preprocessing."""

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image
from skimage import data as skdata

from vae_trainer.data.images import BadImage, crop, decode_base64, load_rgb, open_image, to_float

LIMIT = 4096 * 4096


def _encode(image, fmt="PNG", **options):
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _half(data):
    return data[: len(data) // 2]


def _png16(array):
    """A 16-bit PNG (grey, grey+alpha, RGB or RGBA) written by hand: PIL cannot write 16-bit colour."""
    height, width = array.shape[:2]
    channels = 1 if array.ndim == 2 else array.shape[2]
    colour_type = {1: 0, 2: 4, 3: 2, 4: 6}[channels]
    rows = b"".join(b"\x00" + array[y].astype(">u2").tobytes() for y in range(height))

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 16, colour_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def test_base64_variants_all_decode():
    payload = bytes(range(256)) * 3 + b"\xfb\xff"  # contains bytes that map to + and / in base64
    standard = base64.b64encode(payload)
    assert b"+" in standard or b"/" in standard
    urlsafe_unpadded = base64.urlsafe_b64encode(payload).rstrip(b"=")
    wrapped = b"\n".join(standard[i : i + 76] for i in range(0, len(standard), 76)) + b" \r\n"
    for field in (standard, standard.decode(), urlsafe_unpadded, wrapped):
        assert decode_base64(field) == payload


@pytest.mark.parametrize("field", [b"not base64 at all!!", b"A", b"", "ü€"])
def test_base64_garbage_is_bad_image(field):
    with pytest.raises(BadImage) as error:
        decode_base64(field)
    assert error.value.reason == "base64"


def test_rgb_jpeg_roundtrip_close():
    photo = Image.fromarray(skdata.astronaut()[:64, :48])
    decoded = load_rgb(open_image(_encode(photo, "JPEG", quality=95), LIMIT))
    assert decoded.mode == "RGB" and decoded.size == (48, 64)
    assert np.abs(np.asarray(decoded, np.int16) - np.asarray(photo, np.int16)).mean() < 4


def test_sixteen_bit_grey_is_scaled_not_clipped():
    grey = np.array([[0, 1000, 32896, 65535]], np.uint16)
    decoded = np.asarray(load_rgb(open_image(_png16(grey), LIMIT)))
    expected = np.rint(grey / 257.0).astype(np.uint8)  # 0, 4, 128, 255
    assert decoded.shape == (1, 4, 3)
    np.testing.assert_array_equal(decoded, np.repeat(expected[..., None], 3, axis=2))


def test_sixteen_bit_rgba_composites_on_white():
    rgba = np.array([[[65535, 0, 0, 65535], [0, 0, 65535, 0], [0, 0, 0, 32896]]], np.uint16)
    decoded = np.asarray(load_rgb(open_image(_png16(rgba), LIMIT))).astype(int)
    assert decoded[0, 0].tolist() == [255, 0, 0]  # opaque red stays red
    assert decoded[0, 1].tolist() == [255, 255, 255]  # fully transparent blue becomes white
    assert np.all(np.abs(decoded[0, 2] - 127) <= 1)  # half-transparent black -> mid grey


def test_cmyk_becomes_rgb():
    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))  # no cyan, full magenta+yellow = red
    for encoded in (_encode(cmyk, "JPEG", quality=100), _encode(cmyk, "TIFF")):
        pixel = np.asarray(load_rgb(open_image(encoded, LIMIT)))[4, 4].astype(int)
        assert np.all(np.abs(pixel - [255, 0, 0]) <= 3)


def test_la_and_palette_transparency_composite_on_white():
    la = Image.new("LA", (4, 4), (0, 0))  # black, fully transparent
    la.putpixel((0, 0), (0, 255))
    decoded = np.asarray(load_rgb(open_image(_encode(la), LIMIT)))
    assert decoded[0, 0].tolist() == [0, 0, 0] and decoded[1, 1].tolist() == [255, 255, 255]
    palette = Image.new("P", (4, 4), 1)
    palette.putpalette([0, 255, 0, 10, 20, 30] + [0] * 762)
    palette.putpixel((0, 0), 0)
    decoded = np.asarray(load_rgb(open_image(_encode(palette, transparency=1), LIMIT)))
    assert decoded[0, 0].tolist() == [0, 255, 0] and decoded[2, 2].tolist() == [255, 255, 255]


def test_grayscale_is_replicated():
    grey = Image.fromarray(np.array([[0, 100], [200, 255]], np.uint8), mode="L")
    decoded = np.asarray(load_rgb(open_image(_encode(grey), LIMIT)))
    np.testing.assert_array_equal(decoded[..., 1], np.array([[0, 100], [200, 255]]))
    np.testing.assert_array_equal(decoded[..., 0], decoded[..., 2])


def test_exif_orientation_is_applied():
    image = Image.new("RGB", (40, 20), (255, 0, 0))
    image.paste((0, 0, 255), (0, 0, 20, 20))  # left half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # display rotated 90 degrees clockwise
    decoded = load_rgb(open_image(_encode(image, "JPEG", quality=95, exif=exif), LIMIT))
    assert decoded.size == (20, 40)
    top = np.asarray(decoded)[5, 10].astype(int)  # blue left half is now on top
    assert top[2] > 200 and top[0] < 60


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: b"GIF89a but not really", "not_image"),
        (lambda: b"plain text", "not_image"),
        (lambda: _half(_encode(Image.fromarray(skdata.astronaut()[:64, :64]), "JPEG")), "truncated"),
        (lambda: _half(_encode(Image.fromarray(skdata.astronaut()[:64, :64]), "PNG")), "truncated"),
    ],
)
def test_unusable_data_is_bad_image(make, reason):
    with pytest.raises(BadImage) as error:
        load_rgb(open_image(make(), LIMIT))
    assert error.value.reason == reason


def test_size_limits_are_checked_from_the_header():
    big = _encode(Image.new("L", (300, 200)))
    with pytest.raises(BadImage) as error:
        load_rgb(open_image(big, max_pixels=300 * 200 - 1))
    assert error.value.reason == "too_large"
    assert load_rgb(open_image(big, max_pixels=300 * 200)).size == (300, 200)
    with pytest.raises(BadImage) as error:
        load_rgb(open_image(big, LIMIT, min_size=201))
    assert error.value.reason == "too_small"


def test_preprocess_centre_crop_shape_and_range():
    # 80x40 image: left quarter black, middle half grey ramp, right quarter white.
    pixels = np.zeros((40, 80, 3), np.uint8)
    pixels[:, 60:] = 255
    image = Image.fromarray(pixels)
    out = to_float(crop(image, (20, 20), None, random_flip=True))
    assert out.shape == (3, 20, 20) and out.dtype == np.float32
    assert out.min() >= -1.0 and out.max() <= 1.0
    # resized to 40x20; centre crop covers x in [10, 30): the black/white edge (x=30) is just outside.
    assert np.allclose(out[:, :, :8], -1.0, atol=0.02) and out[:, :, 19].max() < 0


def test_preprocess_random_crop_and_flip_follow_the_rng():
    image = Image.fromarray(skdata.astronaut()[:, :256])  # 512 x 256 -> resized to 64 x 32
    crops = {to_float(crop(image, (32, 32), np.random.default_rng(seed), False)).tobytes() for seed in range(12)}
    assert len(crops) > 3  # different vertical offsets
    first = to_float(crop(image, (32, 32), np.random.default_rng(5), True))
    again = to_float(crop(image, (32, 32), np.random.default_rng(5), True))
    np.testing.assert_array_equal(first, again)
    flips = []
    for seed in range(40):
        rng = np.random.default_rng(seed)
        plain = to_float(crop(image, (32, 32), np.random.default_rng(seed), False))
        flipped = to_float(crop(image, (32, 32), rng, True))
        flips.append(np.array_equal(flipped, plain[:, :, ::-1]) and not np.array_equal(flipped, plain))
    assert 8 <= sum(flips) <= 32  # about half flipped


# ------------------------------------------------------------------------- speed paths and colour


def test_standard_base64_takes_no_regular_expression_pass(monkeypatch):
    class NoRegex:
        def sub(self, *args):
            raise AssertionError("the tolerant path ran on a standard field")

    from vae_trainer.data import images

    payload = bytes(range(256)) * 5
    monkeypatch.setattr(images, "_WHITESPACE", NoRegex())
    assert decode_base64(base64.b64encode(payload)) == payload


def test_jpeg_draft_decodes_small_and_matches_a_full_decode():
    from vae_trainer.data.images import crop, load_rgb, open_image

    photo = skdata.astronaut()  # 512 x 512
    data = _encode(Image.fromarray(photo), "JPEG", quality=95)
    drafted = load_rgb(open_image(data, LIMIT), cover=(64, 64))
    assert drafted.size == (64, 64)  # decoded at 1/8 scale directly
    assert load_rgb(open_image(data, LIMIT), cover=(100, 100)).size == (128, 128)  # 1/4 still covers 100
    assert load_rgb(open_image(data, LIMIT), cover=(300, 300)).size == (512, 512)
    full = crop(load_rgb(open_image(data, LIMIT)), (64, 64), None, False).astype(int)
    fast = crop(drafted, (64, 64), None, False).astype(int)
    assert np.abs(full - fast).mean() < 4


def test_draft_respects_exif_rotation():
    from vae_trainer.data.images import load_rgb, open_image, upright_size

    tall = Image.fromarray(skdata.astronaut()[:, :256])  # 256 wide, 512 high
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: displayed 512 wide, 256 high
    data = _encode(tall.rotate(90, expand=True), "JPEG", quality=95, exif=exif)
    opened = open_image(data, LIMIT)
    assert opened.size == (512, 256) and upright_size(opened) == (256, 512)
    image = load_rgb(opened, cover=(64, 128))
    assert image.size == (64, 128)


def _s15(value):
    return struct.pack(">i", round(value * 65536))


def _icc_desc(description):
    text = description.encode() + b"\0"
    return b"desc" + bytes(4) + struct.pack(">I", len(text)) + text + bytes(4 + 4 + 2 + 1 + 67)


def _icc_xyz(values):
    return b"XYZ " + bytes(4) + b"".join(_s15(v) for v in values)


D50 = (0.9642, 1.0, 0.8249)


def _icc_profile(device_class, colour_space, pcs, tags):
    """A minimal ICC v2 profile, built byte by byte: header, tag table, tag data."""
    tags = tags + [(b"cprt", b"text" + bytes(4) + b"none\0" + bytes(3))]
    offset = 128 + 4 + 12 * len(tags)
    table, data = struct.pack(">I", len(tags)), b""
    for signature, body in tags:
        body += bytes(-len(body) % 4)
        table += signature + struct.pack(">II", offset + len(data), len(body))
        data += body
    size = offset + len(data)
    header = (struct.pack(">I", size) + b"lcms" + bytes([2, 0x10, 0, 0]) + device_class + colour_space + pcs + bytes(12)
              + b"acsp" + bytes(4 + 4 + 4 + 4 + 8 + 4) + b"".join(_s15(v) for v in D50))
    return header + bytes(128 - len(header)) + table + data


def _icc_rgb_profile(description, primaries, white, gamma):
    """A matrix/TRC RGB display profile (what Adobe RGB (1998) is)."""
    curve = b"curv" + bytes(4) + struct.pack(">IH", 1, round(gamma * 256)) + bytes(2)
    tags = [(b"desc", _icc_desc(description)), (b"wtpt", _icc_xyz(white)), (b"rXYZ", _icc_xyz(primaries[0])),
            (b"gXYZ", _icc_xyz(primaries[1])), (b"bXYZ", _icc_xyz(primaries[2])), (b"rTRC", curve),
            (b"gTRC", curve), (b"bTRC", curve)]
    return _icc_profile(b"mntr", b"RGB ", b"XYZ ", tags)


ADOBE_RGB = _icc_rgb_profile("Adobe RGB (1998)-like", [(0.60974, 0.31111, 0.01947), (0.20528, 0.62567, 0.06087),
                                                      (0.14919, 0.06322, 0.74457)], (0.9642, 1.0, 0.8249), 563 / 256)


def _adobe_to_srgb(rgb):
    """Reference: Adobe RGB (1998) -> XYZ (D65) -> sRGB, with the published matrices."""
    linear = (np.asarray(rgb, np.float64) / 255) ** (563 / 256)
    adobe_to_xyz = np.array([[0.5767, 0.1856, 0.1882], [0.2973, 0.6274, 0.0753], [0.0270, 0.0707, 0.9911]])
    xyz_to_srgb = np.array([[3.2406, -1.5372, -0.4986], [-0.9689, 1.8758, 0.0415], [0.0557, -0.2040, 1.0570]])
    srgb = np.clip(xyz_to_srgb @ adobe_to_xyz @ linear, 0, 1)
    encoded = np.where(srgb <= 0.0031308, 12.92 * srgb, 1.055 * srgb ** (1 / 2.4) - 0.055)
    return encoded * 255


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_adobe_rgb_profile_is_converted_to_srgb(fmt):
    colours = [(90, 170, 80), (200, 60, 50), (128, 128, 128), (40, 90, 190)]
    pixels = np.array([[c] * 8 for c in colours], np.uint8).repeat(8, axis=0)  # 32 x 8, four bands
    tagged = _encode(Image.fromarray(pixels), fmt, icc_profile=ADOBE_RGB, **({"quality": 100} if fmt == "JPEG" else {}))
    naive = np.asarray(Image.open(io.BytesIO(tagged)).convert("RGB"), np.float64)
    converted = np.asarray(load_rgb(open_image(tagged, LIMIT)), np.float64)
    for band, colour in enumerate(colours):
        got, plain = converted[band * 8 + 4, 4], naive[band * 8 + 4, 4]
        np.testing.assert_allclose(got, _adobe_to_srgb(colour), atol=4, err_msg=str(colour))
        if colour != (128, 128, 128):  # a wider gamut: the same numbers mean more saturated colours
            assert np.ptp(got) > np.ptp(plain) + 10, (colour, got, plain)
        else:
            assert np.abs(got - plain).max() <= 3  # grey stays grey


def test_srgb_and_broken_profiles_leave_pixels_alone():
    from PIL import ImageCms

    srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    image = Image.fromarray(skdata.astronaut()[:32, :32])
    for profile in (srgb, b"not an icc profile at all"):
        data = _encode(image, "PNG", icc_profile=profile)
        np.testing.assert_array_equal(np.asarray(load_rgb(open_image(data, LIMIT))), np.asarray(image))


def _cmyk_to_lab(c, m, y, k):
    """The press the CMYK test profile describes (inks 0..1): warm paper, inks that darken and tint it."""
    paper = np.array([94.0, 1.0, 9.0])  # L*, a*, b*: a cream paper
    inks = {"c": np.array([-38.0, -30.0, -48.0]), "m": np.array([-46.0, 70.0, -4.0]),
            "y": np.array([-6.0, -8.0, 80.0])}
    lab = paper + c * inks["c"] + m * inks["m"] + y * inks["y"]
    lab[0] = max(lab[0], 10.0)
    return np.array([lab[0] * (1 - 0.85 * k), lab[1] * (1 - k), lab[2] * (1 - k)])


def _icc_cmyk_profile():
    """A CMYK output profile whose A2B0 (a lut16 with a 2-point grid per ink) holds `_cmyk_to_lab` at the corners."""
    grid = []
    for corner in range(16):  # the first ink varies slowest
        inks = [(corner >> (3 - i)) & 1 for i in range(4)]
        lightness, a, b = _cmyk_to_lab(*inks)
        grid += [round(lightness / 100 * 0xFF00), round((a + 128) * 256), round((b + 128) * 256)]
    identity = [1, 0, 0, 0, 1, 0, 0, 0, 1]
    lut = (b"mft2" + bytes(4) + bytes([4, 3, 2, 0]) + b"".join(_s15(v) for v in identity)
           + struct.pack(">HH", 2, 2) + struct.pack(">8H", *[0, 0xFFFF] * 4) + struct.pack(">48H", *grid)
           + struct.pack(">6H", *[0, 0xFFFF] * 3))
    tags = [(b"desc", _icc_desc("Test press (CMYK)")), (b"wtpt", _icc_xyz(D50)), (b"A2B0", lut)]
    return _icc_profile(b"prtr", b"CMYK", b"Lab ", tags)


def test_cmyk_jpeg_with_an_icc_profile_is_converted_as_imagecms_converts_it():
    """An Adobe-style CMYK JPEG with an embedded press profile: the pixels are the profile's colours in sRGB
    (LittleCMS through PIL's ImageCms, perceptual intent), not PIL's naive ink inversion."""
    from PIL import ImageCms

    profile = _icc_cmyk_profile()
    inks = [(0, 0, 0, 0), (255, 0, 0, 0), (0, 200, 40, 0), (30, 30, 220, 20), (0, 0, 0, 200), (90, 60, 0, 40)]
    cmyk = Image.new("CMYK", (8, 8 * len(inks)))
    for band, ink in enumerate(inks):
        cmyk.paste(ink, (0, 8 * band, 8, 8 * band + 8))
    tagged = _encode(cmyk, "JPEG", quality=100, icc_profile=profile)
    opened = Image.open(io.BytesIO(tagged))
    assert opened.mode == "CMYK" and opened.info["icc_profile"] == profile
    reference = ImageCms.profileToProfile(opened, ImageCms.ImageCmsProfile(io.BytesIO(profile)),
                                          ImageCms.createProfile("sRGB"), renderingIntent=0, outputMode="RGB")
    reference = np.asarray(reference, np.float64)
    naive = np.asarray(Image.open(io.BytesIO(tagged)).convert("RGB"), np.float64)
    converted = np.asarray(load_rgb(open_image(tagged, LIMIT)), np.float64)
    assert converted.shape == reference.shape
    for band in range(len(inks)):
        got, want, plain = (pixels[8 * band + 4, 4] for pixels in (converted, reference, naive))
        np.testing.assert_allclose(got, want, atol=2, err_msg=str(inks[band]))
        if any(inks[band]):  # (bare paper is white in both: the perceptual intent maps the paper to white)
            assert np.abs(got - plain).max() > 12, (inks[band], got, plain)  # the profile made a difference

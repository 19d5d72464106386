"""swarm.geo: flat-ground projection, checked by hand and against the replay's own homography."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgerun.sources.replay import ground_to_image
from edgerun.types import Pose
from swarm.geo import CameraPose, ErrorModel, fold_gimbal, project_box, project_boxes, project_points

W, H = 640, 480


def _nadir(up: float = 10.0, hfov: float = 90.0) -> CameraPose:
    return CameraPose(east_m=3.0, north_m=-2.0, up_m=up, hfov_deg=hfov)


def test_nadir_centre_and_edges_by_hand() -> None:
    pose = _nadir()  # f = 320 px: the right edge is 45 degrees off the axis
    fix = project_points(np.array([[320.0, 240.0], [640.0, 240.0], [320.0, 0.0], [0.0, 480.0]]), pose, W, H)
    np.testing.assert_allclose(fix[0, :2], [3.0, -2.0], atol=1e-9)
    np.testing.assert_allclose(fix[1, :2], [13.0, -2.0], atol=1e-9)  # image right = east at yaw 0
    np.testing.assert_allclose(fix[2, :2], [3.0, -2.0 + 7.5], atol=1e-9)  # image up = north: 240/320 * 10 m
    np.testing.assert_allclose(fix[3, :2], [-7.0, -9.5], atol=1e-9)


def test_yawed_east_turns_image_up_to_east() -> None:
    pose = CameraPose(east_m=0.0, north_m=0.0, up_m=10.0, yaw_deg=90.0, hfov_deg=90.0)
    fix = project_points(np.array([[320.0, 0.0]]), pose, W, H)
    np.testing.assert_allclose(fix[0, :2], [7.5, 0.0], atol=1e-9)


def test_pitched_camera_looks_ahead() -> None:
    # Nose up 45 degrees tilts the belly camera forward: the centre ray meets the ground 10 m north.
    pose = CameraPose(east_m=0.0, north_m=0.0, up_m=10.0, pitch_deg=45.0, hfov_deg=60.0)
    fix = project_points(np.array([[320.0, 240.0]]), pose, W, H)
    np.testing.assert_allclose(fix[0, :2], [0.0, 10.0], atol=1e-9)
    # Right wing down 30 degrees tilts it to the left (west).
    rolled = CameraPose(east_m=0.0, north_m=0.0, up_m=10.0, roll_deg=30.0)
    fix = project_points(np.array([[320.0, 240.0]]), rolled, W, H)
    np.testing.assert_allclose(fix[0, :2], [-10.0 * math.tan(math.radians(30.0)), 0.0], atol=1e-9)


def test_rays_at_or_above_the_horizon_get_none() -> None:
    pose = CameraPose(east_m=0.0, north_m=0.0, up_m=10.0, pitch_deg=90.0, hfov_deg=60.0)  # looking at the horizon
    assert project_box((300.0, 0.0, 340.0, 100.0), pose, W, H) is None  # bottom centre above the horizon
    assert project_box((300.0, 200.0, 340.0, 240.0), pose, W, H) is None  # exactly on it
    below = project_box((300.0, 300.0, 340.0, 400.0), pose, W, H)
    assert below is not None and below.north_m > 10.0
    fixes = project_boxes(np.array([[300.0, 0.0, 340.0, 100.0], [300.0, 300.0, 340.0, 400.0]]), pose, W, H)
    assert np.isnan(fixes[0]).all() and np.isfinite(fixes[1]).all()
    # A camera on or below the ground sees no ground point.
    assert project_box((0.0, 0.0, 10.0, 10.0), CameraPose(0.0, 0.0, 0.0), W, H) is None


def test_uncertainty_grows_with_range_and_grazing() -> None:
    errors = ErrorModel(box_px=4.0, attitude_deg=1.0, altitude_m=0.5, position_m=0.0)
    low = project_box((310, 230, 330, 240), _nadir(up=5.0), W, H, errors)
    high = project_box((310, 230, 330, 240), _nadir(up=50.0), W, H, errors)
    assert low is not None and high is not None
    assert high.sigma_m > 5.0 * low.sigma_m
    pose = CameraPose(east_m=0.0, north_m=0.0, up_m=10.0, pitch_deg=60.0, hfov_deg=60.0)
    steep = project_box((310, 400, 330, 470), pose, W, H, errors)  # lower in the image: steeper ray
    flat = project_box((310, 100, 330, 130), pose, W, H, errors)
    assert steep is not None and flat is not None
    assert flat.sigma_m > 3.0 * steep.sigma_m
    # At nadir only the angular terms remain: range x angle.
    fix = project_box((320, 230, 320, 240), _nadir(up=10.0), W, H, errors)
    expected = 10.0 * math.hypot(4.0 / 320.0, math.radians(1.0))
    assert fix is not None and fix.sigma_m == pytest.approx(expected, rel=1e-6)


def test_gimbal_down_equals_belly_camera_and_folds() -> None:
    belly = CameraPose(east_m=1.0, north_m=2.0, up_m=12.0, yaw_deg=30.0)
    # A stabilised gimbal ignores the body's pitch and roll.
    gimbal = CameraPose(
        east_m=1.0, north_m=2.0, up_m=12.0, yaw_deg=30.0, pitch_deg=8.0, roll_deg=-5.0, gimbal_pitch_deg=-90.0
    )
    pts = np.array([[10.0, 20.0], [320.0, 240.0], [600.0, 470.0]])
    np.testing.assert_allclose(project_points(pts, gimbal, W, H), project_points(pts, belly, W, H), atol=1e-9)
    # Gimbal 45 degrees down, 90 degrees right of the heading north: the centre ray lands 12 m east.
    side = CameraPose(east_m=0.0, north_m=0.0, up_m=12.0, gimbal_yaw_deg=90.0, gimbal_pitch_deg=-45.0)
    np.testing.assert_allclose(project_points(np.array([[320.0, 240.0]]), side, W, H)[0, :2], [12.0, 0.0], atol=1e-9)
    folded = fold_gimbal(side)
    assert not folded.has_gimbal
    np.testing.assert_allclose(project_points(pts, folded, W, H), project_points(pts, side, W, H), atol=1e-9)


def test_round_trip_against_replay_homography() -> None:
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(200):
        pose = CameraPose(
            east_m=float(rng.uniform(-50, 50)),
            north_m=float(rng.uniform(-50, 50)),
            up_m=float(rng.uniform(3, 60)),
            yaw_deg=float(rng.uniform(-180, 180)),
            pitch_deg=float(rng.uniform(-40, 40)),
            roll_deg=float(rng.uniform(-40, 40)),
            hfov_deg=float(rng.uniform(40, 100)),
        )
        pixels = np.column_stack([rng.uniform(0, W, 50), rng.uniform(0, H, 50)])
        fixes = project_points(pixels, pose, W, H)
        ok = np.isfinite(fixes[:, 0])
        if not ok.any():
            continue
        hom = ground_to_image(
            Pose(pose.east_m, pose.north_m, pose.up_m, pose.yaw_deg, pose.pitch_deg, pose.roll_deg, pose.hfov_deg),
            W,
            H,
        )
        ground = np.column_stack([fixes[ok, 0], fixes[ok, 1], np.ones(int(ok.sum()))])
        back = ground @ hom.T
        assert (back[:, 2] > 0).all()  # in front of the camera
        np.testing.assert_allclose(back[:, :2] / back[:, 2:], pixels[ok], atol=1e-6)
        checked += int(ok.sum())
    assert checked > 5000


def test_geo_bench_short_form(blazeface_bundle) -> None:
    """BlazeFace over 150 replay frames: projected faces land within centimetres of the truth (exact poses)."""
    import asyncio

    from edgerun.bench.geo import run_geo_bench

    result = asyncio.run(run_geo_bench(frames=150, seed=1, bundle=str(blazeface_bundle.root)))
    matched = result["matched"]
    assert result["frames"] == 150 and matched["count"] >= 30
    assert matched["median_m"] < 0.3 and matched["p90_m"] < 0.6
    assert matched["within_2_sigma"] >= 0.9  # the stated uncertainty covers the error
    assert result["truth_boxes"]["median_m"] < 0.2


# -- the geodetic frame ------------------------------------------------------------------------------------------


def test_a_local_frame_round_trips_and_agrees_with_pyprojs_geodesic_distances() -> None:
    from pyproj import Geod

    from swarm.geo import DEFAULT_ANCHOR, LocalFrame

    frame = LocalFrame(*DEFAULT_ANCHOR)
    east = np.array([0.0, 120.0, -250.0, 900.0])
    north = np.array([0.0, 35.0, 410.0, -700.0])
    lat, lon, alt = frame.to_geodetic(east, north, np.zeros(4))
    assert (lat[0], lon[0]) == pytest.approx(DEFAULT_ANCHOR[:2], abs=1e-12)
    back_e, back_n, back_u = frame.from_geodetic(lat, lon, alt)
    assert np.allclose(back_e, east, atol=1e-6) and np.allclose(back_n, north, atol=1e-6)
    # Horizontal distance on the tangent plane = the WGS84 geodesic (Karney, pyproj.Geod) within 2 cm per km (the
    # plane rises above the ellipsoid by d^2/2R: 10 cm at 1.1 km).
    _, _, dist = Geod(ellps="WGS84").inv(np.full(4, DEFAULT_ANCHOR[1]), np.full(4, DEFAULT_ANCHOR[0]), lon, lat)
    assert np.allclose(dist, np.hypot(east, north), rtol=2e-5, atol=1e-3)


@pytest.mark.parametrize(("lat0", "lon0"), [(53.117, -4.13), (-33.9, 151.2), (0.0, 179.9995), (69.6, 18.9)])
def test_ground_offsets_match_the_geodesic_and_invert(lat0: float, lon0: float) -> None:
    from pyproj import Geod

    from swarm.geo import ground_offset_m, offset_latlon

    geod = Geod(ellps="WGS84")
    for az, d in [(0.0, 5.0), (90.0, 250.0), (200.0, 1500.0), (315.0, 4000.0)]:
        lon, lat, _ = geod.fwd(lon0, lat0, az, d)  # crosses the antimeridian in one case
        east, north = ground_offset_m(lat0, lon0, lat, lon)
        assert math.hypot(east, north) == pytest.approx(d, rel=1e-4)
        assert math.degrees(math.atan2(east, north)) % 360.0 == pytest.approx(az, abs=0.05)
        back = offset_latlon(lat0, lon0, east, north)
        assert back == pytest.approx((lat, lon), abs=1e-8)


def test_a_frame_refuses_an_origin_off_the_globe() -> None:
    from swarm.geo import LocalFrame

    for bad in [(91.0, 0.0, 0.0), (0.0, 181.0, 0.0), (float("nan"), 0.0, 0.0), (0.0, 0.0, float("inf"))]:
        with pytest.raises(ValueError, match="frame origin"):
            LocalFrame(*bad)

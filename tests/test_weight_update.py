"""The weight-update protocol bodies (arealite.api.weight_update): wire JSON round trips and the
refusals a server sends back, naming the field."""

import json

import pytest
import torch

from arealite.api.weight_update import (DEFAULT_GROUP_NAME, DiskUpdate, InitGroup, ProtocolError, UpdateBucket,
                                        destroy_group_body, dtype_name, parse_destroy_group, parse_dtype,
                                        parse_version, reply)
from arealite.server.protocol import error_body


def test_init_group_round_trip_and_string_port():
    body = {"master_address": "10.0.0.1", "master_port": "29500", "rank_offset": 3, "world_size": 5}
    req = InitGroup.from_json(body, default_backend="gloo")
    assert req == InitGroup("10.0.0.1", 29500, 3, 5, DEFAULT_GROUP_NAME, "gloo")
    assert req.to_json() == {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 3,
                             "world_size": 5, "group_name": "weight_update_group", "backend": "gloo"}
    assert InitGroup.from_json(json.loads(json.dumps(req.to_json()))) == req


@pytest.mark.parametrize("change, field", [
    ({"rank_offset": 0}, "rank_offset"),  # rank 0 is the trainer
    ({"rank_offset": 5}, "rank_offset"),  # == world_size
    ({"rank_offset": True}, "rank_offset"),  # a bool is no rank
    ({"backend": "mpi"}, "backend"),
    ({"master_port": "x"}, "body"),
    ({"master_address": 7}, "master_address"),
])
def test_init_group_refusals_name_the_field(change, field):
    body = dict({"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2}, **change)
    with pytest.raises(ProtocolError) as info:
        InitGroup.from_json(body)
    assert info.value.field == field


def test_bucket_of_tensors_round_trip_and_version_only_when_set():
    tensors = [("a.weight", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b.bias", torch.zeros(4))]
    first = UpdateBucket.of_tensors(tensors, "g")
    assert first.to_json() == {"names": ["a.weight", "b.bias"], "dtypes": ["bfloat16", "float32"],
                               "shapes": [[2, 3], [4]], "group_name": "g", "flush_cache": True}
    last = UpdateBucket.of_tensors(tensors, "g", weight_version=7)
    assert last.to_json()["weight_version"] == 7
    assert UpdateBucket.from_json(last.to_json()) == last
    assert last.torch_dtypes() == [torch.bfloat16, torch.float32]
    # SGLang's weight_version is a string: a numeric one is accepted
    assert UpdateBucket.from_json(dict(first.to_json(), weight_version="8")).weight_version == 8


@pytest.mark.parametrize("change, field", [
    ({"dtypes": ["bfloat16"]}, "names"),  # lengths differ
    ({"shapes": [[2, 3], [4.0]]}, "names"),  # not integers
    ({"dtypes": ["bfloat16", "float33"]}, "dtypes"),
    ({"weight_version": "v1"}, "weight_version"),
])
def test_bucket_refusals_name_the_field(change, field):
    body = dict({"names": ["a", "b"], "dtypes": ["bfloat16", "float32"], "shapes": [[2, 3], [4]]}, **change)
    with pytest.raises(ProtocolError) as info:
        UpdateBucket.from_json(body)
    assert info.value.field == field


def test_disk_update_destroy_and_reply_bodies():
    assert DiskUpdate("/w", 4, True).to_json() == {"model_path": "/w", "weight_version": 4,
                                                   "abort_all_requests": True}
    assert DiskUpdate.from_json({"model_path": "/w", "weight_version": "4"}) == DiskUpdate("/w", 4, False)
    with pytest.raises(ProtocolError, match="model_path"):
        DiskUpdate.from_json({"model_path": 3})
    assert parse_destroy_group(destroy_group_body("g")) == "g"
    assert parse_destroy_group(None) == DEFAULT_GROUP_NAME
    assert reply(True, "ok", weight_version=3) == {"success": True, "message": "ok", "weight_version": 3}
    assert error_body("bad", "names") == {"success": False, "message": "bad",
                                          "error": {"message": "bad", "field": "names"}}


def test_dtype_names_and_versions():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        assert parse_dtype(dtype_name(dtype)) is dtype
    assert parse_dtype("torch.bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'Size'"):
        parse_dtype("Size")  # torch.Size exists but is no dtype
    assert [parse_version(v) for v in (None, 3, "12", "-1")] == [None, 3, 12, -1]
    with pytest.raises(ValueError, match="weight_version"):
        parse_version(1.5)

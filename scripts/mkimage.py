#!/usr/bin/env python3
"""Writes an OCI image layout from layer directories, for the test images.

usage: mkimage.py OUT_DIR TAG [--env K=V ...] LAYER[:gzip|:zstd|:none] ...

Each LAYER is a directory turned into a tar (numeric owners, sorted, fixed
mtimes so the digests are reproducible) and compressed as asked (gzip by
default). Entries named `.wh.*` in a layer directory are OCI whiteouts.
"""
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile


def layer_tar(src):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for root, dirs, files in os.walk(src):
            dirs.sort()
            for name in sorted(dirs) + sorted(files):
                full = os.path.join(root, name)
                arc = os.path.relpath(full, src)
                info = t.gettarinfo(full, arcname=arc)
                info.uname = info.gname = ""
                info.mtime = 1700000000
                if info.isreg():
                    with open(full, "rb") as f:
                        t.addfile(info, f)
                else:
                    t.addfile(info)
    return buf.getvalue()


def compress(data, how):
    if how == "none":
        return data, "application/vnd.oci.image.layer.v1.tar"
    if how == "zstd":
        out = subprocess.run(["zstd", "-q", "-3", "-c"], input=data, check=True, capture_output=True).stdout
        return out, "application/vnd.oci.image.layer.v1.tar+zstd"
    out = subprocess.run(["gzip", "-n", "-1", "-c"], input=data, check=True, capture_output=True).stdout
    return out, "application/vnd.oci.image.layer.v1.tar+gzip"


def put_blob(out, data):
    d = hashlib.sha256(data).hexdigest()
    path = os.path.join(out, "blobs", "sha256", d)
    with open(path, "wb") as f:
        f.write(data)
    return "sha256:" + d


def main(argv):
    out, tag = argv[0], argv[1]
    env, layers = [], []
    rest = argv[2:]
    while rest:
        a = rest.pop(0)
        if a == "--env":
            env.append(rest.pop(0))
        else:
            layers.append(a)
    os.makedirs(os.path.join(out, "blobs", "sha256"), exist_ok=True)
    descs, diff_ids = [], []
    for spec in layers:
        path, _, how = spec.partition(":")
        raw = layer_tar(path)
        diff_ids.append("sha256:" + hashlib.sha256(raw).hexdigest())
        data, media = compress(raw, how or "gzip")
        descs.append({"mediaType": media, "digest": put_blob(out, data), "size": len(data)})
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": env or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }
    cfg = json.dumps(config, sort_keys=True).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": put_blob(out, cfg), "size": len(cfg)},
        "layers": descs,
    }
    mb = json.dumps(manifest, sort_keys=True).encode()
    index = {
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": put_blob(out, mb),
            "size": len(mb),
            "annotations": {"org.opencontainers.image.ref.name": tag},
            "platform": {"architecture": "amd64", "os": "linux"},
        }],
    }
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(out, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)


if __name__ == "__main__":
    main(sys.argv[1:])

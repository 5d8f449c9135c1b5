"""An S3-compatible server that checks every request against the caller's IAM policy: moto's server in its
own process (its authentication switch is process-wide), one IAM user per role.

moto names three S3 actions its own way: a HEAD of an object is `s3:HeadObject` (AWS: s3:GetObject), a
listing `s3:ListObjectsV2` (AWS: s3:ListBucket) and a copy `s3:CopyObject` (AWS: s3:PutObject on the copy). `moto_dialect` adds those names beside the AWS ones; it
removes nothing, so what moto allows the AWS policy allows. moto does not evaluate the `s3:prefix`
condition of a listing (it allows any prefix), so listings are not what these tests check."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import urllib.request

from bench.cleanup import stop_process_group
from pipelines.prefect_api import free_port, wait_for_http

ROOT_CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
ALIASES = {"s3:GetObject": ["s3:HeadObject"], "s3:ListBucket": ["s3:ListObjectsV2", "s3:ListObjects"],
           "s3:PutObject": ["s3:CopyObject"]}
ALL_POWERFUL = {"Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": ["s3:*"], "Resource": ["arn:aws:s3:::*"]}]}


def moto_dialect(policy: dict) -> dict:
    out = copy.deepcopy(policy)
    for st in out["Statement"]:
        st["Action"] = list(st["Action"]) + [a for act in st["Action"] for a in ALIASES.get(act, [])]
    return out


class IamS3:
    """`with IamS3(log_path) as s3:` a bucket, principals made with `principal`, then `enforce()`."""

    def __init__(self, log_path: str, bucket: str = "spes-iam"):
        self.port, self.bucket, self.log_path = free_port(), bucket, log_path
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "IamS3":
        self._log = open(self.log_path, "w")
        env = dict(os.environ, **ROOT_CREDS)
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_for_http(f"{self.endpoint}/moto-api/", self.proc, "the moto server", 60)
            self._client("s3").create_bucket(Bucket=self.bucket)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        stop_process_group(self.proc, 10)
        self._log.close()

    def _client(self, service: str):
        import boto3

        return boto3.client(service, endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def principal(self, name: str, policy: dict) -> dict:
        """An IAM user holding `policy` (AWS's names; moto's are added); its credentials as environment."""
        iam = self._client("iam")
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName=f"{name}-policy", PolicyDocument=json.dumps(moto_dialect(policy)))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
                "AWS_DEFAULT_REGION": "us-east-1"}

    def enforce(self) -> None:
        """From now on every request is checked against its key's policy (the root test keys stop working)."""
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                     headers={"Content-Type": "text/plain"})  # a form body would be parsed away
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200

    def options(self, creds: dict) -> dict:
        """fsspec storage options for a key (storage.options)."""
        return {"endpoint_url": self.endpoint, "key": creds["AWS_ACCESS_KEY_ID"],
                "secret": creds["AWS_SECRET_ACCESS_KEY"]}

"""Conditional writes of one S3 object (If-None-Match, If-Match), for the run lease.

pyarrow's S3 filesystem writes unconditionally, so two processes could both take a run's
lease. S3 (since 2024) and moto refuse a PUT whose condition fails with 412, which
makes taking and renewing the lease a compare-and-swap. This is a small SigV4-signed HTTP
client for that one object, with the credentials of the AWS_* variables; where they are
not set (an instance profile, a web identity) the lease keeps pyarrow's writes.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import os
import re
from datetime import datetime, timezone
from urllib.parse import quote, urlsplit

TIMEOUT_S = 30.0
REGION = re.compile(r"[a-z0-9-]{1,40}")


class Unsupported(Exception):
    """The server does not take conditional writes (501, or an unknown header refused)."""


class ConditionalObject:
    def __init__(self, bucket: str, key: str, access_key: str, secret_key: str, token: str | None,
                 region: str, endpoint: str | None):
        self.key_path = "/" + quote(key, safe="/-_.~")
        self.access_key, self.secret_key, self.token = access_key, secret_key, token
        self.bucket, self.endpoint = bucket, endpoint
        if endpoint:  # an S3-compatible server: path style
            e = urlsplit(endpoint)
            self.scheme, self.host = e.scheme or "https", e.netloc
            self.path = "/" + quote(bucket, safe="-_.~") + self.key_path
        else:
            self.scheme = "https"
            self.path = self.key_path
        self._set_region(region)

    def _set_region(self, region: str) -> None:
        self.region = region
        if not self.endpoint:
            self.host = f"{self.bucket}.s3.{region}.amazonaws.com"

    @classmethod
    def from_env(cls, root: str, *rel: str) -> "ConditionalObject | None":
        """The object `root/rel...` (root: bucket/prefix), or None without credentials in the environment."""
        access, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
        if not access or not secret:
            return None
        bucket, _, prefix = root.partition("/")
        key = "/".join(p for p in (prefix, *rel) if p)
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3")
        return cls(bucket, key, access, secret, os.environ.get("AWS_SESSION_TOKEN"), region, endpoint)

    def get(self) -> tuple[bytes, str] | None:
        """(body, ETag), or None when there is no such object."""
        status, headers, body = self._send("GET", b"", {})
        if status == 404:
            return None
        self._check(status, body)
        return body, headers.get("etag", "")

    def put(self, body: bytes, *, if_match: str | None = None) -> str | None:
        """Write the object only if it is absent (if_match None) or still has ETag `if_match`:
        its new ETag, or None when another writer came first."""
        condition = {"if-match": if_match} if if_match is not None else {"if-none-match": "*"}
        status, headers, answer = self._send("PUT", body, condition)
        if status in (409, 412) or (status == 404 and if_match is not None):
            return None  # 409: a concurrent conditional write; 404: the version read was deleted since
        self._check(status, answer)
        return headers.get("etag", "")

    @staticmethod
    def _check(status: int, body: bytes) -> None:
        if status == 501 or (status == 400 and b"NotImplemented" in body):
            raise Unsupported(f"HTTP {status}")
        if status in (301, 307) or (status == 400 and b"AuthorizationHeaderMalformed" in body):
            raise Unsupported(f"HTTP {status}: the bucket's region could not be found")  # pyarrow's writes find it
        if status >= 300:
            raise OSError(f"S3 answered HTTP {status}: {body[:300].decode('utf-8', 'replace')}")

    def _send(self, method: str, body: bytes, extra: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        """One request; sent once more, signed for the bucket's region, when S3 names another
        region than the one signed for (AWS_REGION unset, or not the bucket's)."""
        status, headers, answer = self._send_once(method, body, extra)
        if status in (301, 307, 400):
            region = headers.get("x-amz-bucket-region") or _region_in(answer)
            if region and REGION.fullmatch(region) and region != self.region:  # it becomes part of a host name
                self._set_region(region)
                status, headers, answer = self._send_once(method, body, extra)
        return status, headers, answer

    def _send_once(self, method: str, body: bytes, extra: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        now = datetime.now(timezone.utc)
        headers = {"host": self.host, "x-amz-date": now.strftime("%Y%m%dT%H%M%SZ"),
                   "x-amz-content-sha256": hashlib.sha256(body).hexdigest(), **extra}
        if self.token:
            headers["x-amz-security-token"] = self.token
        headers["authorization"] = self._authorization(method, headers, now)
        conn_type = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = conn_type(self.host, timeout=TIMEOUT_S)
        try:
            conn.request(method, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        except (OSError, http.client.HTTPException) as e:  # as the store's own errors: no errno, not a disk's
            raise OSError(f"{method} {self.scheme}://{self.host}{self.path}: {e}") from None
        finally:
            conn.close()

    def _authorization(self, method: str, headers: dict[str, str], now: datetime) -> str:
        """AWS Signature Version 4, as S3 documents it, over every header sent."""
        names = sorted(headers)
        canonical = "\n".join([method, self.path, "", *(f"{n}:{headers[n].strip()}" for n in names), "",
                               ";".join(names), headers["x-amz-content-sha256"]])
        day = now.strftime("%Y%m%d")
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", headers["x-amz-date"], scope,
                             hashlib.sha256(canonical.encode()).hexdigest()])
        key = ("AWS4" + self.secret_key).encode()
        for part in (day, self.region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        return (f"AWS4-HMAC-SHA256 Credential={self.access_key}/{scope}, SignedHeaders={';'.join(names)}, "
                f"Signature={signature}")


def _region_in(body: bytes) -> str | None:
    """The region an S3 error names (<Region> of AuthorizationHeaderMalformed, PermanentRedirect's endpoint)."""
    found = re.search(rb"<Region>([a-z0-9-]+)</Region>", body)
    if found is None:
        found = re.search(rb"<Endpoint>[^<]*?\.s3[.-]([a-z0-9-]+)\.amazonaws\.com</Endpoint>", body)
    return found.group(1).decode() if found else None

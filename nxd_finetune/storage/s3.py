"""S3 backend of :mod:`nxd_finetune.storage`; the only module of the project that imports boto3.

Configuration (constructor argument first, then environment, then boto3's own defaults):

- credentials: boto3's default chain (env keys, ``AWS_PROFILE``/shared files, SSO, container or
  instance role); ``profile=`` picks a named profile;
- endpoint: ``endpoint_url=``, ``NXD_S3_ENDPOINT_URL``, ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``
  (MinIO, moto, on-prem gateways); ``NXD_S3_ADDRESSING_STYLE`` = ``auto|path|virtual``;
- region: ``region=``, ``AWS_REGION``, ``AWS_DEFAULT_REGION``;
- retries: botocore ``standard`` mode with ``max_attempts`` (default 5) for throttling and 5xx;
- uploads above ``multipart_threshold`` (default 64 MiB) go in ``multipart_chunksize`` parts
  (S3 needs parts of at least 5 MiB; s3transfer raises smaller values to that).

Conditional create uses ``PutObject(IfNoneMatch='*')`` (S3 since 2024-08, honoured by moto 5.2 with
412 PreconditionFailed); a 409 ConditionalRequestConflict (a concurrent conditional write in flight)
is retried. A push killed during a multipart upload leaves an incomplete upload that is invisible
but billed: :meth:`S3Storage.leftovers` lists such uploads and ``nxd-finetune adapters gc`` aborts
them (a bucket ``AbortIncompleteMultipartUpload`` lifecycle rule is a good backstop).

Every botocore failure is turned into a one-line :class:`StorageError` subclass naming the URI.
"""

from __future__ import annotations

import base64
import os
import threading
import time

import boto3
import botocore.exceptions as bce
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from nxd_finetune.storage.base import Keys, Leftover, Leftovers, ObjectHead, Progress, Storage, check_key
from nxd_finetune.storage.errors import (
    StorageAccessDeniedError,
    StorageBucketNotFoundError,
    StorageCredentialsError,
    StorageError,
    StorageNotFoundError,
)

_MIB = 1 << 20
_CRED_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "TokenRefreshRequired"}
_DENIED_CODES = {"AccessDenied", "AllAccessDisabled", "403", "Forbidden"}
_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
# Environment that changes which credentials the default chain finds: part of the client cache key.
_CREDENTIAL_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
)
_clients: dict[tuple, object] = {}
_clients_lock = threading.Lock()


def _env(*names: str) -> str | None:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    return None


def translate_error(exc: BaseException, uri: str, op: str) -> StorageError:
    """Map a boto3/botocore exception raised by ``op`` on ``uri`` to a one-line :class:`StorageError`."""
    if isinstance(exc, S3UploadFailedError):  # boto3 raises it while handling the real error
        inner = exc.__cause__ or exc.__context__
        if not isinstance(inner, bce.BotoCoreError | bce.ClientError):
            return StorageError(f"S3 {op} on {uri} failed: {exc}".replace("\n", " "))
        exc = inner
    if isinstance(exc, bce.ProfileNotFound):
        return StorageCredentialsError(f"AWS profile {exc.kwargs.get('profile')!r} not found (for {uri})")
    if isinstance(exc, bce.NoCredentialsError | bce.PartialCredentialsError | bce.CredentialRetrievalError):
        return StorageCredentialsError(
            f"no usable AWS credentials for {uri}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or run with an instance/container role"
        )
    if isinstance(exc, bce.EndpointConnectionError | bce.ConnectionError):
        return StorageError(f"cannot reach the S3 endpoint for {uri}: {exc}".replace("\n", " "))
    if isinstance(exc, bce.ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        if code == "NoSuchBucket":
            bucket = uri[len("s3://") :].split("/", 1)[0]
            return StorageBucketNotFoundError(f"S3 bucket {bucket!r} does not exist ({uri})")
        if code in _CRED_CODES:
            return StorageCredentialsError(f"AWS credentials rejected for {uri} ({code}): check the key id/secret")
        if code in _DENIED_CODES:
            return StorageAccessDeniedError(f"access denied: {op} on {uri} (check the IAM/bucket policy)")
        if code in _NOT_FOUND_CODES:
            return StorageNotFoundError(f"{uri} does not exist")
        message = str(err.get("Message", "")).replace("\n", " ")
        return StorageError(f"S3 {op} on {uri} failed: {code} {message}".strip())
    if isinstance(exc, bce.BotoCoreError):
        return StorageError(f"S3 {op} on {uri} failed: {exc}".replace("\n", " "))
    raise TypeError(f"not a boto error: {exc!r}") from exc


class S3Storage(Storage):
    """Objects under ``s3://bucket/prefix/``; see the module docstring for configuration."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        multipart_threshold: int = 64 * _MIB,
        multipart_chunksize: int = 64 * _MIB,
        max_concurrency: int = 8,
        max_attempts: int = 5,
    ):
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.endpoint_url = endpoint_url or _env("NXD_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
        self.region = region or _env("AWS_REGION", "AWS_DEFAULT_REGION")
        self.profile = profile
        self.transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
        )
        self._max_attempts = max_attempts
        self.botocore_config = Config(
            retries={"max_attempts": max_attempts, "mode": "standard"},
            connect_timeout=10,
            read_timeout=120,
            s3={"addressing_style": os.environ.get("NXD_S3_ADDRESSING_STYLE", "auto")},
        )
        self._client_obj = None

    @classmethod
    def from_uri(cls, uri: str, **options) -> S3Storage:
        """``s3://BUCKET[/PREFIX]`` -> storage; a URI without a bucket raises :class:`StorageError`."""
        rest = uri[len("s3://") :]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise StorageError(f"S3 URI {uri!r} names no bucket (expected s3://BUCKET[/PREFIX])")
        if prefix.strip("/"):
            check_key(prefix.strip("/"))
        return cls(bucket, prefix, **options)

    # -- plumbing ---------------------------------------------------------------------------------

    @property
    def _client(self):
        """A boto3 S3 client, shared between storages of the same settings and credential environment.

        Creating a client costs ~0.1 s (service model, endpoint rules); clients are thread-safe.
        """
        if self._client_obj is None:
            key = (
                self.profile,
                self.endpoint_url,
                self.region,
                self._max_attempts,
                os.environ.get("NXD_S3_ADDRESSING_STYLE"),
                *(os.environ.get(k) for k in _CREDENTIAL_ENV),
            )
            with _clients_lock:
                if key not in _clients:
                    try:
                        session = boto3.session.Session(profile_name=self.profile)
                        _clients[key] = session.client(
                            "s3", endpoint_url=self.endpoint_url, region_name=self.region, config=self.botocore_config
                        )
                    except (bce.BotoCoreError, bce.ClientError) as e:
                        raise translate_error(e, self.uri, "connect") from None
                self._client_obj = _clients[key]
        return self._client_obj

    def _key(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _call(self, op: str, key: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (bce.BotoCoreError, bce.ClientError, S3UploadFailedError) as e:
            raise translate_error(e, f"s3://{self.bucket}/{self.prefix}{key}".rstrip("/"), op) from None

    # -- Storage ----------------------------------------------------------------------------------

    def put_file(self, local: str | os.PathLike, key: str, progress: Progress | None = None) -> None:
        k = self._key(key)
        self._call(
            "upload",
            key,
            self._client.upload_file,
            os.fspath(local),
            self.bucket,
            k,
            Config=self.transfer,
            Callback=progress,
        )

    def put_bytes(self, key: str, data: bytes, if_none_match: bool = False) -> bool:
        k = self._key(key)
        extra = {"IfNoneMatch": "*"} if if_none_match else {}
        for attempt in range(6):
            try:
                self._client.put_object(Bucket=self.bucket, Key=k, Body=data, **extra)
                return True
            except bce.ClientError as e:
                code = str(e.response.get("Error", {}).get("Code", ""))
                if if_none_match and code == "PreconditionFailed":
                    return False
                if if_none_match and code == "ConditionalRequestConflict" and attempt < 5:
                    time.sleep(0.05 * 2**attempt)
                    continue
                raise translate_error(e, f"s3://{self.bucket}/{k}", "PutObject") from None
            except bce.BotoCoreError as e:
                raise translate_error(e, f"s3://{self.bucket}/{k}", "PutObject") from None
        raise AssertionError("unreachable")

    def get_file(self, key: str, local: str | os.PathLike) -> None:
        k = self._key(key)
        self._call("download", key, self._client.download_file, self.bucket, k, os.fspath(local), Config=self.transfer)

    def get_bytes(self, key: str) -> bytes:
        k = self._key(key)
        resp = self._call("GetObject", key, self._client.get_object, Bucket=self.bucket, Key=k)
        return self._call("GetObject", key, resp["Body"].read)

    def head(self, key: str) -> ObjectHead:
        """Size, ETag and (when the object carries one) the sha256 of object ``key``: user metadata
        ``sha256`` (hex), else S3's ``ChecksumSHA256`` of a single-part upload. Missing:
        :class:`StorageNotFoundError`."""
        resp = self._call("HeadObject", key, self._client.head_object, Bucket=self.bucket, Key=self._key(key),
                          ChecksumMode="ENABLED")
        sha256 = (resp.get("Metadata") or {}).get("sha256")
        checksum = resp.get("ChecksumSHA256")
        if not sha256 and checksum and "-" not in checksum:  # "<b64>-<parts>": a checksum of part checksums
            sha256 = base64.b64decode(checksum).hex()
        return ObjectHead(size=int(resp["ContentLength"]), etag=str(resp.get("ETag", "")).strip('"'),
                          sha256=sha256.lower() if sha256 else None)

    def exists(self, key: str) -> bool:
        try:
            self._call("HeadObject", key, self._client.head_object, Bucket=self.bucket, Key=self._key(key))
            return True
        except StorageNotFoundError:
            return False

    def _pages(self, prefix: str, **kwargs):
        paginator = self._client.get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix, **kwargs)
        return self._call("ListObjectsV2", prefix, list, pages)

    def list(self, prefix: str = "") -> Keys:
        n = len(self.prefix)
        return sorted(obj["Key"][n:] for page in self._pages(prefix) for obj in page.get("Contents", []))

    def list_dirs(self, prefix: str = "") -> Keys:
        if prefix and not prefix.endswith("/"):
            raise StorageError(f"list_dirs needs '' or a prefix ending in '/', got {prefix!r}")
        n = len(self.prefix) + len(prefix)
        pages = self._pages(prefix, Delimiter="/")
        return sorted(cp["Prefix"][n:].rstrip("/") for page in pages for cp in page.get("CommonPrefixes", []))

    def leftovers(self, prefix: str = "") -> Leftovers:
        """Incomplete multipart uploads under ``prefix`` (``handle`` is the upload id)."""
        paginator = self._client.get_paginator("list_multipart_uploads")
        pages = self._call("ListMultipartUploads", prefix, list,
                           paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix))
        n = len(self.prefix)
        now = time.time()
        found = []
        for page in pages:
            for up in page.get("Uploads", []):
                age = now - up["Initiated"].timestamp() if "Initiated" in up else 0.0
                found.append(Leftover(up["Key"][n:], max(0.0, age), None, up["UploadId"]))
        return sorted(found, key=lambda x: (x.key, x.handle))

    def drop_leftover(self, item: Leftover) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=self._key(item.key), UploadId=item.handle)
        except bce.ClientError as e:
            if str(e.response.get("Error", {}).get("Code", "")) != "NoSuchUpload":
                raise translate_error(e, f"{self.uri}/{item.key}", "AbortMultipartUpload") from None
        except bce.BotoCoreError as e:
            raise translate_error(e, f"{self.uri}/{item.key}", "AbortMultipartUpload") from None

    def delete(self, key: str) -> None:
        self._call("DeleteObject", key, self._client.delete_object, Bucket=self.bucket, Key=self._key(key))

    def delete_prefix(self, prefix: str) -> int:
        if not prefix.endswith("/"):
            raise StorageError(f"delete_prefix needs a prefix ending in '/', got {prefix!r}")
        keys = self.list(prefix)
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self.prefix + k} for k in keys[i : i + 1000]]
            resp = self._call(
                "DeleteObjects",
                prefix,
                self._client.delete_objects,
                Bucket=self.bucket,
                Delete={"Objects": batch, "Quiet": True},
            )
            if resp.get("Errors"):
                err = resp["Errors"][0]
                raise StorageError(
                    f"S3 DeleteObjects under {self.uri}/{prefix} failed: {err.get('Code')} {err.get('Key')}"
                )
        return len(keys)

"""An OAUTHBEARER token callback for Amazon MSK IAM authentication (extra `detok[aws-msk-iam]`).

MSK's IAM listener takes a SigV4-signed token from `aws-msk-iam-sasl-signer-python` in place of
a password; librdkafka asks for a fresh one through `oauth_cb` before the old one expires. Named
in a properties file as

    security.protocol=SASL_SSL
    sasl.mechanism=OAUTHBEARER
    oauth_cb=workers.kafka.msk_iam:oauth_cb
    sasl.oauthbearer.config=region=eu-west-1

The region comes from `sasl.oauthbearer.config` (`region=...`), else $AWS_REGION or
$AWS_DEFAULT_REGION; credentials from the signer's usual AWS chain (env, profile, instance role).
The signer is imported on the first call, so the extra costs nothing to a deployment without it.
"""

from __future__ import annotations

import os

REGION_ENV = ("AWS_REGION", "AWS_DEFAULT_REGION")


class MskIamConfigError(ValueError):
    """The callback cannot sign: no region, or the extra is not installed."""


def region_from(oauthbearer_config: str | None) -> str:
    """`region=...` of librdkafka's `sasl.oauthbearer.config` (space- or comma-separated pairs),
    else the AWS region environment variables."""
    for pair in (oauthbearer_config or "").replace(",", " ").split():
        key, _, value = pair.partition("=")
        if key.strip() == "region" and value.strip():
            return value.strip()
    for name in REGION_ENV:
        if os.environ.get(name):
            return os.environ[name]
    raise MskIamConfigError(
        "MSK IAM needs a region: sasl.oauthbearer.config=region=<region> or $AWS_REGION"
    )


def oauth_cb(oauthbearer_config: str | None) -> tuple[str, float]:
    """librdkafka's token callback: (token, expiry as seconds since the epoch)."""
    try:
        from aws_msk_iam_sasl_signer import MSKAuthTokenProvider
    except ImportError as error:
        raise MskIamConfigError(
            "MSK IAM needs the signer: pip install 'detok[aws-msk-iam]'"
        ) from error
    token, expiry_ms = MSKAuthTokenProvider.generate_auth_token(region_from(oauthbearer_config))
    return token, expiry_ms / 1000

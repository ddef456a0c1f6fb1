"""AWS credentials from profiles (`AWS_PROFILE`, `~/.aws/credentials`), via boto3.

Design notes: docs/reference/design.md#storage-remote-aws.
"""

from __future__ import annotations

import os
import pathlib

# Keys of `storage_options` that give S3 credentials or ask for none.
_EXPLICIT = ("access_key_id", "aws_access_key_id", "skip_signature")


def shared_files() -> list[pathlib.Path]:
    """The AWS shared credentials and config files that exist."""
    home = pathlib.Path.home()
    files = [
        os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials",
        os.environ.get("AWS_CONFIG_FILE") or home / ".aws" / "config",
    ]
    return [pathlib.Path(f) for f in files if pathlib.Path(f).is_file()]


def cache_key() -> tuple:
    """What of the environment decides the profile route (for store caches)."""
    names = (
        "AWS_PROFILE",
        "AWS_ACCESS_KEY_ID",
        "AWS_SHARED_CREDENTIALS_FILE",
        "AWS_CONFIG_FILE",
    )
    return (str(pathlib.Path.home()), *(os.environ.get(n) for n in names))


def apply_profile(root: str, options: dict):
    """The credential provider of the profile route, or None (obstore's chain).

    Pops `profile` from `options` and adds the profile's `region` and
    `endpoint` where neither `options` nor the environment gives them.
    """
    profile = options.pop("profile", None)
    explicit = [k for k in _EXPLICIT if options.get(k)]
    if explicit:
        if profile is not None:
            raise ValueError(
                f"{root}: storage_options names profile={profile!r} and also "
                f"{explicit}; give one or the other"
            )
        return None
    env_profile = os.environ.get("AWS_PROFILE")
    if profile is None:
        if os.environ.get("AWS_ACCESS_KEY_ID"):
            return None  # the environment's keys come first, as in every AWS SDK
        if not env_profile and not shared_files():
            return None
    named = profile or env_profile
    try:
        import botocore.exceptions
        import botocore.session
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        if named is None:
            return None  # only files without a named profile: obstore's chain
        raise ImportError(
            f"{root}: reading credentials of AWS profile {named!r} needs boto3 "
            "(obstore does not read ~/.aws profiles): pip install "
            "'grain_cells[aws]', or export the profile's keys: "
            'eval "$(aws configure export-credentials --format env)"'
        ) from None
    try:
        session = botocore.session.Session(profile=profile)
        credentials = session.get_credentials()
        scoped = session.get_scoped_config()
    except botocore.exceptions.ProfileNotFound:
        files = ", ".join(map(str, shared_files())) or "no shared file exists"
        raise ValueError(
            f"{root}: AWS profile {named!r} is not in the shared files ({files}). "
            "Name an existing profile (storage_options['profile'] or "
            "AWS_PROFILE), or add it with `aws configure --profile NAME`."
        ) from None
    except botocore.exceptions.BotoCoreError as e:
        raise PermissionError(
            f"{root}: AWS profile {named or 'default'!r} cannot give credentials "
            f"({e}). Fix the profile in {', '.join(map(str, shared_files()))}."
        ) from None
    if credentials is None:
        if named is None:
            return None  # nothing in the files: obstore's chain (instance roles)
        raise PermissionError(
            f"{root}: AWS profile {named!r} gives no credentials; add "
            "aws_access_key_id/aws_secret_access_key (or sso_*, role_arn, "
            "credential_process) to it."
        )
    if not options.get("region") and not (
        os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    ):
        region = session.get_config_variable("region")
        if region:
            options["region"] = region
    if not (options.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL")):
        s3_section = scoped.get("s3") if isinstance(scoped.get("s3"), dict) else {}
        endpoint = s3_section.get("endpoint_url") or scoped.get("endpoint_url")
        if endpoint:
            options["endpoint"] = endpoint
    return Boto3CredentialProvider(session)

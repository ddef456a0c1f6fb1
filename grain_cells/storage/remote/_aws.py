"""AWS credentials from profiles (`AWS_PROFILE`, `~/.aws/credentials`), via boto3.

Design notes: docs/reference/design.md#storage-remote-aws.
"""

from __future__ import annotations

import os
import pathlib


def cache_key() -> tuple:
    """What of the environment decides the profile route (for store caches)."""
    names = "AWS_PROFILE AWS_ACCESS_KEY_ID AWS_SHARED_CREDENTIALS_FILE AWS_CONFIG_FILE"
    return (str(pathlib.Path.home()), *map(os.environ.get, names.split(" ")))


def _shared_files() -> str:
    """The AWS shared credentials and config files that exist, comma-separated."""
    aws = pathlib.Path.home() / ".aws"
    env = os.environ.get
    files = [env("AWS_SHARED_CREDENTIALS_FILE") or aws / "credentials"]
    files = map(pathlib.Path, [*files, env("AWS_CONFIG_FILE") or aws / "config"])
    return ", ".join(str(f) for f in files if f.is_file())


def apply_profile(root: str, options: dict):
    """A profile's credential provider, or None; sets its region and endpoint."""
    profile = options.pop("profile", None)
    keys = ("access_key_id", "aws_access_key_id", "skip_signature")  # or none
    explicit = [k for k in keys if options.get(k)]
    if explicit:
        if profile is not None:
            raise ValueError(
                f"{root}: storage_options names profile={profile!r} and also "
                f"{explicit}; give one or the other"
            )
        return None
    named = profile or os.environ.get("AWS_PROFILE")
    # The environment's keys come first, as in every AWS SDK.
    if profile is None and (
        os.environ.get("AWS_ACCESS_KEY_ID") or not (named or _shared_files())
    ):
        return None
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
        raise ValueError(
            f"{root}: AWS profile {named!r} is not in the shared files "
            f"({_shared_files() or 'no shared file exists'}). Name an existing "
            "profile (storage_options['profile'] or AWS_PROFILE), or add it with "
            "`aws configure --profile NAME`."
        ) from None
    except botocore.exceptions.BotoCoreError as e:
        raise PermissionError(
            f"{root}: AWS profile {named or 'default'!r} cannot give credentials "
            f"({e}). Fix the profile in {_shared_files()}."
        ) from None
    if credentials is None:
        if named is None:
            return None  # nothing in the files: obstore's chain (instance roles)
        raise PermissionError(
            f"{root}: AWS profile {named!r} gives no credentials; add "
            "aws_access_key_id/aws_secret_access_key (or sso_*, role_arn, "
            "credential_process) to it."
        )
    env_region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    region = (
        None
        if options.get("region") or env_region
        else session.get_config_variable("region")
    )
    if region:
        options["region"] = region
    if not (options.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL")):
        s3_section = scoped.get("s3") if isinstance(scoped.get("s3"), dict) else {}
        if endpoint := s3_section.get("endpoint_url") or scoped.get("endpoint_url"):
            options["endpoint"] = endpoint
    return Boto3CredentialProvider(session)

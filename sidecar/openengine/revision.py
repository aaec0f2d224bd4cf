"""The OpenEngine schema revision this build speaks, and the release it was generated from."""

#: Revision of the OpenEngine v1 wire contract our bindings were generated at.
CLIENT_REVISION = 3
#: Oldest server revision whose wire shape we still understand.
OLDEST_SERVER_REVISION = 1
#: Immutable commit of ai-dynamo/openengine that schema/ reproduces.
SCHEMA_RELEASE = "a66ff6f73a65e262a7c3edd5ea6fd0d8701d402f"
#: Repository the release refers to.
SCHEMA_REPOSITORY = "ai-dynamo/openengine"


def spec_url(section: str = "") -> str:
    """Where the schema's field-level rules are written: its ``docs/api.md`` at
    :data:`SCHEMA_RELEASE`, optionally at one section's anchor."""
    url = f"https://github.com/{SCHEMA_REPOSITORY}/blob/{SCHEMA_RELEASE}/docs/api.md"
    return f"{url}#{section}" if section else url

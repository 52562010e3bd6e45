"""Report table schemas (pandera). Owns what a report table must look like; never reads files."""

from schemas.report_tables import (  # noqa: F401
    READABLE_VERSIONS,
    SCHEMA_VERSION,
    SCHEMAS,
    TableFailure,
    validate_tables,
)

"""One timestamp format on every admin page, lists and detail pages alike (FORMAT_MODULE_PATH
in settings): ISO dates and 24-hour times with the zone (TIME_ZONE)."""

DATE_FORMAT = "Y-m-d"
DATETIME_FORMAT = "Y-m-d H:i:s T"
SHORT_DATE_FORMAT = DATE_FORMAT
SHORT_DATETIME_FORMAT = DATETIME_FORMAT
TIME_FORMAT = "H:i:s"

"""PostgreSQL's type OIDs of the types a source's columns are read from
(``src/include/catalog/pg_type.dat``), for the scan (:mod:`.scan`) and the choice of what it
reads (:mod:`.data`)."""

BOOL_OID, INT8_OID, INT2_OID, INT4_OID, FLOAT4_OID, FLOAT8_OID, NUMERIC_OID = 16, 20, 21, 23, 700, 701, 1700
TEXT_OID, VARCHAR_OID = 25, 1043
INT2_ARRAY_OID, INT4_ARRAY_OID, INT8_ARRAY_OID, FLOAT4_ARRAY_OID, FLOAT8_ARRAY_OID, NUMERIC_ARRAY_OID = (
    1005, 1007, 1016, 1021, 1022, 1231)

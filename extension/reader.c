/*
 * reader.c: tensile._read_columns, the scan that reads training and prediction data.
 *
 * tensile._read_columns(statement, columns, kinds, required, width, skip_holes, want_kept,
 * scan_fd, max_nbytes) runs one query (the statement the backend builds around the user's source:
 * exactly one, as the caller's role, planned without parallel workers so that the rows arrive in
 * the source's order) and sends its rows to a DestReceiver of its own, which writes each value
 * read, in native byte order, into a memory file the caller made (memfd_create, named
 * SCAN_FILE_NAME): no aggregate state, no bytea per value, no result value copied into SPI's tuple
 * table and then into Python. Python maps the file and views each column as an array in place.
 *
 * Output column i reads statement column columns[i] as kinds[i]:
 *   'f' float4 a row, from real, smallint, integer, bigint or boolean (0 or 1), as their casts
 *       to real give it; the 'f' columns flagged in `required` side by side in one region, the
 *       matrix, a row of them after another (each of the others in a region of its own)
 *   'd' float8 a row, from double precision, real, smallint, integer, bigint or boolean
 *   'i' int64 a row, from smallint, integer or bigint
 *   't' an int32 code a row, from text or varchar, dictionary-encoded: each distinct value (its
 *       UTF-8 bytes, converted from the database's encoding as convert_to(x, 'UTF8')) gets the
 *       next code in order of first appearance; -1 for NULL
 *   'a' a real[]'s elements, flattened in row-major order
 * (the statement casts any other type to one of these; a NULL in a number column is NaN, or 0 as
 * int64). A row is complete when no output column flagged in `required` reads a NULL (and, with
 * skip_holes, no array holds a NULL element); only complete rows are written. The result, a JSON
 * object, counts the rows and the complete rows and places each region of the file: one per
 * output column (empty for a column in the matrix), then the kept mask (one byte a row, with
 * want_kept), then the text columns' dictionaries (per text column: the number of distinct
 * values, then each one's byte length and bytes; int32 native), then the matrix. For each array
 * column it gives the arrays with NULL elements (holes, over every row), the least and most
 * elements of a complete row's array (lo, hi: null without one), the complete rows whose array
 * does not hold `width` elements (off; those are not written) and the dimensions of the arrays
 * written (ndim of the first, and whether any other differs).
 *
 * Note [A sparse scan file]
 * -------------------------
 * Rationale: the row count is not known until the scan ends, and each column must end up
 * contiguous for Python to view it as an array without a copy. Buffers grown in backend memory and
 * written out at the end would hold every value twice (1.4 GB at the peak for ten million rows of
 * 16 real columns and a label) and copy each once more.
 *
 * Approach: each region has its own stretch of the file, REGION_STRIDE (1 GiB) apart: a memory
 * file is sparse, so only the pages written take memory. Each column's values gather in a buffer
 * of BUFFER_NBYTES that goes to its place in the file (pwrite) whenever it fills: reading
 * 1,000,000 rows of 16 real columns and a label, the function took 0.47 to 0.50 s writing each
 * value through a shared mapping of the file, where every first store to a page faulted (about
 * 110 ms of page faults a scan, 35 ms more to unmap and free them), and 0.26 to 0.36 s with the
 * buffers and the numeric features side by side (one row of them after another, in one region:
 * one stream of stores instead of one a column). A real column that keeps its NULLs (for
 * imputation) has a region of its own instead: the passes that test and fill such a column go
 * column by column, and a pass over a column of the matrix reads every cache line of it (testing
 * each of 16 columns of 1,000,000 rows for non-finite values: 0.12 s on the matrix's columns,
 * 0.014 s on columns of their own). The statement projects bare columns where this file converts
 * their type, in the source's order: when a row's columns are all read, PostgreSQL then hands the
 * scan's own tuples over without a projection (EXPLAIN ANALYZE of the same rows: 0.27 s with a
 * cast of each column, 0.09 s with none).
 *
 * Limitations: all regions together hold at most max_nbytes, never more than MAX_SCAN_NBYTES (1
 * GB, PostgreSQL's largest value, as when the scan was one row of aggregates): a scan that would
 * read more stops with SQLSTATE 54000 before it writes past it, so no source can make the backend
 * hold more (beyond a buffer a column). Python maps REGION_STRIDE of address space a region (about
 * 1.6 TB for the 1,664 columns a query may have; a 64-bit process has 128 TB) and no memory beyond
 * the pages written.
 */
#include "postgres.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "catalog/pg_type_d.h"
#include "common/hashfn.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "lib/stringinfo.h"
#include "mb/pg_wchar.h"
#include "utils/array.h"
#include "utils/builtins.h"
#include "utils/float.h"
#include "utils/hsearch.h"
#include "utils/memutils.h"

PG_FUNCTION_INFO_V1(tensile_read_columns);

/* Whether a scan runs in this backend now (see tensile_read_columns). */
static bool scanning = false;

/* Bytes all regions of a scan file may hold together. */
#define MAX_SCAN_NBYTES ((Size) MaxAllocSize)
/* Bytes from one region's start to the next's (Note [A sparse scan file]). */
#define REGION_STRIDE ((Size) MaxAllocSize + 1)
/* Bytes a column gathers before they go to the file. */
#define BUFFER_NBYTES ((Size) 65536)
/* Output columns one scan reads at most: a query's most columns (a row of the matrix then fits a
 * buffer, and the buffers take at most MAX_COLUMNS * BUFFER_NBYTES: 104 MiB). */
#define MAX_COLUMNS MaxTupleAttributeNumber
/* Bytes of backend memory a dictionary entry takes beyond its value's (the hash entry, the copy's
 * chunk header), counted against MAX_SCAN_NBYTES with the value: many distinct values cannot make
 * the dictionary outgrow the limit. */
#define DICT_ENTRY_NBYTES 64
/* The name the caller gives the scan file (memfd_create); the reader writes into no other file. */
#define SCAN_FILE_NAME "tensile_db-scan"

/* How one output column reads its statement column: the kind written and the type converted. */
typedef enum Conversion
{
	FLOAT4_FROM_FLOAT4,
	FLOAT4_FROM_INT2,
	FLOAT4_FROM_INT4,
	FLOAT4_FROM_INT8,
	FLOAT4_FROM_BOOL,
	FLOAT8_FROM_FLOAT8,
	FLOAT8_FROM_FLOAT4,
	FLOAT8_FROM_INT2,
	FLOAT8_FROM_INT4,
	FLOAT8_FROM_INT8,
	FLOAT8_FROM_BOOL,
	INT8_FROM_INT2,
	INT8_FROM_INT4,
	INT8_FROM_INT8,
	TEXT_CODES,
	FLOAT4_ARRAY
} Conversion;

typedef struct DictKey
{
	const char *bytes;			/* UTF-8; a copy in the reader's context, once entered */
	int			nbytes;
} DictKey;

typedef struct DictEntry
{
	DictKey		key;
	int32		code;
} DictEntry;

typedef struct ReadColumn
{
	int			attno;			/* its statement column, 0-based */
	char		kind;			/* 'f', 'd', 'i', 't' or 'a' */
	Conversion	conversion;
	bool		required;		/* a NULL here makes the row incomplete */
	bool		in_matrix;		/* an 'f' column that refuses NULLs: its values go in the matrix */
	Size		within;			/* in the matrix: its value's byte offset in a row of it */
	off_t		offset;			/* where its buffer goes in the file */
	char	   *buffer;			/* BUFFER_NBYTES */
	char	   *at;				/* where its next value goes in the buffer */
	Size		nbytes;			/* bytes written to its region, the buffer's included */
	/* text: the dictionary */
	HTAB	   *codes_of;		/* DictKey -> DictEntry */
	StringInfoData values;		/* each distinct value's int32 length and bytes, in code order */
	int32		distinct;
	/* real[] */
	int64		holes;			/* arrays with a NULL element, over every row */
	int64		off;			/* complete rows whose array does not hold `width` elements */
	int64		lo;				/* least and most elements of a complete row's array; -1: none yet */
	int64		hi;
	int			ndim;			/* dimensions of the first array written; -1: none yet */
	bool		mixed_ndim;		/* an array written since had another number */
	ArrayType  *row_array;		/* this row's array, detoasted once (in the row's context) */
} ReadColumn;

typedef struct ColumnReader
{
	DestReceiver pub;
	int			ncolumns;
	ReadColumn *columns;
	int64		width;			/* elements every array must hold; -1: as many as each other */
	bool		skip_holes;		/* an array's NULL element makes the row incomplete */
	bool		want_kept;
	int			fd;				/* the scan file */
	Size		max_nbytes;		/* what the regions may hold together, at most MAX_SCAN_NBYTES */
	Size		total_nbytes;	/* written to every region together (and the dictionaries' memory) */
	Size		row_nbytes;		/* a complete row's bytes in the fixed-width columns, matrix included */
	ReadColumn	kept;			/* the kept mask, a column of one byte a row */
	ReadColumn	matrix;			/* the 'f' columns' values, a row of float4 after another */
	Size		matrix_row_nbytes;
	int64		rows;
	int64		complete;
	MemoryContext context;		/* the reader's state and dictionaries */
	MemoryContext row_context;	/* detoasted values and converted text of one row; reset each row */
} ColumnReader;

static uint32
dict_hash(const void *key, Size keysize)
{
	const DictKey *k = (const DictKey *) key;

	return hash_bytes((const unsigned char *) k->bytes, k->nbytes);
}

static int
dict_match(const void *a, const void *b, Size keysize)
{
	const DictKey *x = (const DictKey *) a;
	const DictKey *y = (const DictKey *) b;

	return x->nbytes == y->nbytes && memcmp(x->bytes, y->bytes, x->nbytes) == 0 ? 0 : 1;
}

/* Count nbytes more against the limit; stop the scan (SQLSTATE 54000) beyond it. */
static inline void
reserve(ColumnReader *reader, Size nbytes)
{
	if (unlikely(nbytes > reader->max_nbytes - reader->total_nbytes))
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("the columns read take more than %zu bytes", reader->max_nbytes)));
	reader->total_nbytes += nbytes;
}

/* Write nbytes at offset of the scan file. */
static void
write_file(ColumnReader *reader, const char *data, Size nbytes, off_t offset)
{
	while (nbytes > 0)
	{
		ssize_t		written = pwrite(reader->fd, data, nbytes, offset);

		if (written < 0 && errno == EINTR)
			continue;
		if (written <= 0)
			ereport(ERROR,
					(errcode(ERRCODE_OUT_OF_MEMORY),
					 errmsg("tensile._read_columns: could not write %zu bytes to the scan file: %m", nbytes)));
		data += written;
		nbytes -= written;
		offset += written;
	}
}

/* Send a column's buffer to its place in the file and empty it. */
static void
flush(ColumnReader *reader, ReadColumn *column)
{
	Size		nbytes = column->at - column->buffer;

	write_file(reader, column->buffer, nbytes, column->offset);
	column->offset += nbytes;
	column->nbytes += nbytes;
	column->at = column->buffer;
}

/* Room for nbytes more in a column's buffer. */
static inline void
room(ColumnReader *reader, ReadColumn *column, Size nbytes)
{
	if (unlikely(column->at + nbytes > column->buffer + BUFFER_NBYTES))
	{
		if (nbytes > BUFFER_NBYTES)		/* a row of the matrix: at most MAX_COLUMNS values */
			elog(ERROR, "tensile._read_columns: %zu bytes do not fit a buffer of %zu", nbytes, BUFFER_NBYTES);
		flush(reader, column);
	}
}

/* Append nbytes of any size to a column (counted already). */
static void
append(ColumnReader *reader, ReadColumn *column, const void *data, Size nbytes)
{
	if (nbytes > BUFFER_NBYTES)
	{
		flush(reader, column);
		write_file(reader, data, nbytes, column->offset);
		column->offset += nbytes;
		column->nbytes += nbytes;
		return;
	}
	room(reader, column, nbytes);
	memcpy(column->at, data, nbytes);
	column->at += nbytes;
}

/* A text value's dictionary code, entering it when new. */
static int32
text_code(ColumnReader *reader, ReadColumn *column, Datum datum)
{
	text	   *value = DatumGetTextPP(datum);
	DictKey		key;
	DictEntry  *entry;
	bool		found;

	key.nbytes = VARSIZE_ANY_EXHDR(value);
	key.bytes = pg_server_to_any(VARDATA_ANY(value), key.nbytes, PG_UTF8);
	if (key.bytes != VARDATA_ANY(value))
		key.nbytes = strlen(key.bytes);
	entry = (DictEntry *) hash_search(column->codes_of, &key, HASH_ENTER, &found);
	if (!found)
	{
		char	   *copy = MemoryContextAlloc(reader->context, key.nbytes + 1);
		int32		length = key.nbytes;
		int			capacity = column->values.maxlen;

		memcpy(copy, key.bytes, key.nbytes);
		entry->key.bytes = copy;
		entry->code = column->distinct++;
		appendBinaryStringInfo(&column->values, (const char *) &length, sizeof(length));
		appendBinaryStringInfo(&column->values, key.bytes, key.nbytes);
		/* the memory the value takes: its hash entry, its copy, and what the values' buffer grew */
		reserve(reader, DICT_ENTRY_NBYTES + GetMemoryChunkSpace(copy) + (column->values.maxlen - capacity));
	}
	return entry->code;
}

/* A complete row's array: counted, and its elements written where it holds `width` of them (NULL
 * ones as NaN: a row with one is written only where the caller then refuses the scan, naming the
 * column). */
static void
append_array(ColumnReader *reader, ReadColumn *column, ArrayType *array)
{
	int64		count = ArrayGetNItems(ARR_NDIM(array), ARR_DIMS(array));
	float4	   *elements = (float4 *) ARR_DATA_PTR(array);
	bits8	   *bitmap = ARR_NULLBITMAP(array);
	int64		i;

	column->lo = column->lo < 0 ? count : Min(column->lo, count);
	column->hi = Max(column->hi, count);
	if (reader->width >= 0 && count != reader->width)
	{
		column->off++;
		return;
	}
	if (column->ndim < 0)
		column->ndim = ARR_NDIM(array);
	else if (column->ndim != ARR_NDIM(array))
		column->mixed_ndim = true;
	reserve(reader, count * sizeof(float4));
	if (bitmap == NULL)
		append(reader, column, elements, count * sizeof(float4));
	else
		for (i = 0; i < count; i++)
		{
			float4		value = (bitmap[i / 8] & (1 << (i % 8))) ? *elements++ : get_float4_nan();

			append(reader, column, &value, sizeof(value));
		}
}

/* Store one value of another fixed-width column in its buffer; its bytes are counted per row. */
#define STORE(type, value) \
	do { \
		type		v_ = (value); \
		room(reader, column, sizeof(type)); \
		memcpy(column->at, &v_, sizeof(type)); \
		column->at += sizeof(type); \
	} while (0)

/* Store one value of an 'f' column: in its place in the matrix's row (room for the row was made),
 * else in its own buffer. */
static inline void
store_float4(ColumnReader *reader, ReadColumn *column, float4 value)
{
	if (column->in_matrix)
		memcpy(reader->matrix.at + column->within, &value, sizeof(value));
	else
		STORE(float4, value);
}

/* Write one complete row's value of a column. */
static inline void
append_value(ColumnReader *reader, ReadColumn *column, Datum datum, bool isnull)
{
	switch (column->conversion)
	{
		case FLOAT4_FROM_FLOAT4:
			store_float4(reader, column, isnull ? get_float4_nan() : DatumGetFloat4(datum));
			break;
		case FLOAT4_FROM_INT2:
			store_float4(reader, column, isnull ? get_float4_nan() : (float4) DatumGetInt16(datum));
			break;
		case FLOAT4_FROM_INT4:
			store_float4(reader, column, isnull ? get_float4_nan() : (float4) DatumGetInt32(datum));
			break;
		case FLOAT4_FROM_INT8:
			store_float4(reader, column, isnull ? get_float4_nan() : (float4) DatumGetInt64(datum));
			break;
		case FLOAT4_FROM_BOOL:
			store_float4(reader, column, isnull ? get_float4_nan() : DatumGetBool(datum) ? 1.0f : 0.0f);
			break;
		case FLOAT8_FROM_FLOAT8:
			STORE(float8, isnull ? get_float8_nan() : DatumGetFloat8(datum));
			break;
		case FLOAT8_FROM_FLOAT4:
			STORE(float8, isnull ? get_float8_nan() : (float8) DatumGetFloat4(datum));
			break;
		case FLOAT8_FROM_INT2:
			STORE(float8, isnull ? get_float8_nan() : (float8) DatumGetInt16(datum));
			break;
		case FLOAT8_FROM_INT4:
			STORE(float8, isnull ? get_float8_nan() : (float8) DatumGetInt32(datum));
			break;
		case FLOAT8_FROM_INT8:
			STORE(float8, isnull ? get_float8_nan() : (float8) DatumGetInt64(datum));
			break;
		case FLOAT8_FROM_BOOL:
			STORE(float8, isnull ? get_float8_nan() : DatumGetBool(datum) ? 1.0 : 0.0);
			break;
		case INT8_FROM_INT2:
			STORE(int64, isnull ? 0 : (int64) DatumGetInt16(datum));
			break;
		case INT8_FROM_INT4:
			STORE(int64, isnull ? 0 : (int64) DatumGetInt32(datum));
			break;
		case INT8_FROM_INT8:
			STORE(int64, isnull ? 0 : DatumGetInt64(datum));
			break;
		case TEXT_CODES:
			STORE(int32, isnull ? -1 : text_code(reader, column, datum));
			break;
		case FLOAT4_ARRAY:
			if (!isnull)		/* else a column the caller refuses NULLs in, and names */
				append_array(reader, column, column->row_array);
			break;
	}
}

static bool
reader_receive(TupleTableSlot *slot, DestReceiver *self)
{
	ColumnReader *reader = (ColumnReader *) self;
	MemoryContext old = MemoryContextSwitchTo(reader->row_context);
	bool		complete = true;
	int			i;

	slot_getallattrs(slot);
	for (i = 0; i < reader->ncolumns; i++)
	{
		ReadColumn *column = &reader->columns[i];

		if (slot->tts_isnull[column->attno])
		{
			if (column->required)
				complete = false;
			continue;
		}
		if (column->kind != 'a')
			continue;
		column->row_array = DatumGetArrayTypeP(slot->tts_values[column->attno]);
		if (array_contains_nulls(column->row_array))
		{
			column->holes++;
			if (reader->skip_holes)
				complete = false;
		}
	}
	reader->rows++;
	if (reader->want_kept)
	{
		reserve(reader, 1);
		room(reader, &reader->kept, 1);
		*reader->kept.at++ = complete;
	}
	if (complete)
	{
		reader->complete++;
		reserve(reader, reader->row_nbytes);
		if (reader->matrix_row_nbytes > 0)
			room(reader, &reader->matrix, reader->matrix_row_nbytes);
		for (i = 0; i < reader->ncolumns; i++)
		{
			ReadColumn *column = &reader->columns[i];

			append_value(reader, column, slot->tts_values[column->attno], slot->tts_isnull[column->attno]);
		}
		reader->matrix.at += reader->matrix_row_nbytes;
	}
	MemoryContextSwitchTo(old);
	MemoryContextReset(reader->row_context);
	return true;
}

/* How a column of kind `kind` reads a statement column of type `type`. */
static Conversion
conversion_of(char kind, Oid type, int column)
{
	switch (kind)
	{
		case 'f':
			if (type == FLOAT4OID)
				return FLOAT4_FROM_FLOAT4;
			if (type == INT2OID)
				return FLOAT4_FROM_INT2;
			if (type == INT4OID)
				return FLOAT4_FROM_INT4;
			if (type == INT8OID)
				return FLOAT4_FROM_INT8;
			if (type == BOOLOID)
				return FLOAT4_FROM_BOOL;
			break;
		case 'd':
			if (type == FLOAT8OID)
				return FLOAT8_FROM_FLOAT8;
			if (type == FLOAT4OID)
				return FLOAT8_FROM_FLOAT4;
			if (type == INT2OID)
				return FLOAT8_FROM_INT2;
			if (type == INT4OID)
				return FLOAT8_FROM_INT4;
			if (type == INT8OID)
				return FLOAT8_FROM_INT8;
			if (type == BOOLOID)
				return FLOAT8_FROM_BOOL;
			break;
		case 'i':
			if (type == INT2OID)
				return INT8_FROM_INT2;
			if (type == INT4OID)
				return INT8_FROM_INT4;
			if (type == INT8OID)
				return INT8_FROM_INT8;
			break;
		case 't':
			if (type == TEXTOID || type == VARCHAROID)
				return TEXT_CODES;
			break;
		case 'a':
			if (type == FLOAT4ARRAYOID)
				return FLOAT4_ARRAY;
			break;
	}
	elog(ERROR, "tensile._read_columns cannot read a column of type %u as kind '%c' (output column %d)",
		 type, kind, column + 1);
	return FLOAT4_FROM_FLOAT4;	/* not reached */
}

static void
reader_startup(DestReceiver *self, int operation, TupleDesc typeinfo)
{
	ColumnReader *reader = (ColumnReader *) self;
	MemoryContext old;
	int			i;

	for (i = 0; i < reader->ncolumns; i++)
	{
		ReadColumn *column = &reader->columns[i];

		if (column->attno < 0 || column->attno >= typeinfo->natts)
			elog(ERROR, "tensile._read_columns: output column %d reads statement column %d of %d",
				 i + 1, column->attno + 1, typeinfo->natts);
		column->conversion = conversion_of(column->kind, TupleDescAttr(typeinfo, column->attno)->atttypid, i);
		reader->row_nbytes += column->kind == 'f' ? sizeof(float4) : column->kind == 'd' ? sizeof(float8) :
			column->kind == 'i' ? sizeof(int64) : column->kind == 't' ? sizeof(int32) : 0;
		if (column->kind == 't')
		{
			HASHCTL		ctl;

			ctl.keysize = sizeof(DictKey);
			ctl.entrysize = sizeof(DictEntry);
			ctl.hash = dict_hash;
			ctl.match = dict_match;
			ctl.hcxt = reader->context;
			column->codes_of = hash_create("tensile_db categories", 64, &ctl,
										   HASH_ELEM | HASH_FUNCTION | HASH_COMPARE | HASH_CONTEXT);
			/* in the reader's context, not the executor's, which is gone when the scan ends */
			old = MemoryContextSwitchTo(reader->context);
			initStringInfo(&column->values);
			MemoryContextSwitchTo(old);
			/* its number of values in the dictionary region, and the values' buffer */
			reserve(reader, sizeof(int32) + column->values.maxlen);
		}
	}
}

static void
reader_nothing(DestReceiver *self)
{
}

/* Raise an error unless fd is a memory file named SCAN_FILE_NAME: the function writes into no
 * other file of the backend (its relations' files among them), whatever number it is given. */
static void
check_scan_file(int fd)
{
	const char *expected = "/memfd:" SCAN_FILE_NAME " ";
	char		link[64];
	char		target[128];
	ssize_t		length;
	struct stat st;

	snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
	length = readlink(link, target, sizeof(target) - 1);
	if (length >= 0)
		target[length] = '\0';
	if (length < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || strncmp(target, expected, strlen(expected)) != 0)
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("tensile._read_columns: file descriptor %d is not a scan file", fd)));
}

/* Check and size the scan file: ncolumns + 3 regions, holes until written. */
static void
open_scan_file(ColumnReader *reader, int fd)
{
	check_scan_file(fd);
	reader->fd = fd;
	if (ftruncate(fd, (off_t) ((reader->ncolumns + 3) * REGION_STRIDE)) != 0)
		ereport(ERROR,
				(errcode_for_file_access(),
				 errmsg("tensile._read_columns: could not size the scan file: %m")));
}

static SPIPlanPtr
prepare_one(const char *statement)
{
	SPIPlanPtr	plan = SPI_prepare(statement, 0, NULL);

	if (plan == NULL)
		elog(ERROR, "tensile._read_columns: SPI_prepare failed: %s", SPI_result_code_string(SPI_result));
	/* A cursor plan is exactly one query that returns rows: text after a ';' never runs. */
	if (!SPI_is_cursor_plan(plan))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_CURSOR_DEFINITION),
				 errmsg("tensile._read_columns reads exactly one query")));
	return plan;
}

/* Send what the buffers hold and the dictionaries to the file; the layout and counts as JSON
 * (see the top). */
static text *
finish(ColumnReader *reader)
{
	StringInfoData out;
	Size		dictionary_nbytes = 0;
	off_t		dictionary = (off_t) (reader->ncolumns + 1) * REGION_STRIDE;
	bool		first = true;
	int			i;

	for (i = 0; i < reader->ncolumns; i++)
		flush(reader, &reader->columns[i]);
	flush(reader, &reader->kept);
	flush(reader, &reader->matrix);
	initStringInfo(&out);
	appendStringInfo(&out, "{\"rows\": " INT64_FORMAT ", \"complete\": " INT64_FORMAT ", \"regions\": [",
					 reader->rows, reader->complete);
	for (i = 0; i < reader->ncolumns; i++)
		appendStringInfo(&out, "[%zu, %zu], ", (Size) i * REGION_STRIDE, reader->columns[i].nbytes);
	appendStringInfo(&out, "[%zu, %zu], ", (Size) reader->ncolumns * REGION_STRIDE, reader->kept.nbytes);
	for (i = 0; i < reader->ncolumns; i++)		/* counted against the limit as they grew */
	{
		ReadColumn *column = &reader->columns[i];

		if (column->kind != 't')
			continue;
		write_file(reader, (const char *) &column->distinct, sizeof(int32), dictionary + dictionary_nbytes);
		write_file(reader, column->values.data, column->values.len, dictionary + dictionary_nbytes + sizeof(int32));
		dictionary_nbytes += sizeof(int32) + column->values.len;
	}
	appendStringInfo(&out, "[%zu, %zu], [%zu, %zu]], \"arrays\": {", (Size) (reader->ncolumns + 1) * REGION_STRIDE,
					 dictionary_nbytes, (Size) (reader->ncolumns + 2) * REGION_STRIDE, reader->matrix.nbytes);
	for (i = 0; i < reader->ncolumns; i++)
	{
		ReadColumn *column = &reader->columns[i];

		if (column->kind != 'a')
			continue;
		appendStringInfo(&out, "%s\"%d\": {\"holes\": " INT64_FORMAT ", \"off\": " INT64_FORMAT ", ",
						 first ? "" : ", ", i, column->holes, column->off);
		first = false;
		if (column->lo < 0)
			appendStringInfoString(&out, "\"lo\": null, \"hi\": null, ");
		else
			appendStringInfo(&out, "\"lo\": " INT64_FORMAT ", \"hi\": " INT64_FORMAT ", ", column->lo, column->hi);
		appendStringInfo(&out, "\"ndim\": %d, \"mixed_ndim\": %s}", column->ndim,
						 column->mixed_ndim ? "true" : "false");
	}
	appendStringInfoString(&out, "}}");
	return cstring_to_text_with_len(out.data, out.len);
}

/* A column's region, the region-th of the file, and its buffer if it has values of its own. */
static void
place(ColumnReader *reader, ReadColumn *column, int region, bool buffered)
{
	column->offset = (off_t) region * REGION_STRIDE;
	if (buffered)
		column->buffer = column->at = MemoryContextAlloc(reader->context, BUFFER_NBYTES);
}

/* The reader of the output columns the arguments describe, in its own memory context. */
static ColumnReader *
make_reader(FunctionCallInfo fcinfo)
{
	MemoryContext context = AllocSetContextCreate(CurrentMemoryContext, "tensile_db reader", ALLOCSET_DEFAULT_SIZES);
	ColumnReader *reader = MemoryContextAllocZero(context, sizeof(ColumnReader));
	ArrayType  *columns = PG_GETARG_ARRAYTYPE_P(1);
	text	   *kinds = PG_GETARG_TEXT_PP(2);
	ArrayType  *required = PG_GETARG_ARRAYTYPE_P(3);
	Datum	   *attnos;
	Datum	   *flags;
	bool	   *nulls;
	int			n;
	int			nflags;
	int			i;

	deconstruct_array(columns, INT4OID, 4, true, TYPALIGN_INT, &attnos, &nulls, &n);
	deconstruct_array(required, BOOLOID, 1, true, TYPALIGN_CHAR, &flags, NULL, &nflags);
	if (nflags != n || VARSIZE_ANY_EXHDR(kinds) != n || array_contains_nulls(columns) || array_contains_nulls(required))
		ereport(ERROR,
				(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
				 errmsg("tensile._read_columns: columns, kinds and required must have one entry per output column")));
	if (n > MAX_COLUMNS)
		ereport(ERROR,
				(errcode(ERRCODE_PROGRAM_LIMIT_EXCEEDED),
				 errmsg("tensile._read_columns reads at most %d output columns, not %d", MAX_COLUMNS, n)));
	reader->context = context;
	reader->row_context = AllocSetContextCreate(context, "tensile_db reader row", ALLOCSET_SMALL_SIZES);
	reader->ncolumns = n;
	reader->columns = MemoryContextAllocZero(context, Max(n, 1) * sizeof(ReadColumn));
	for (i = 0; i < n; i++)
	{
		ReadColumn *column = &reader->columns[i];

		column->attno = DatumGetInt32(attnos[i]) - 1;
		column->kind = VARDATA_ANY(kinds)[i];
		column->required = DatumGetBool(flags[i]);
		column->lo = column->hi = -1;
		column->ndim = -1;
		if (strchr("fdita", column->kind) == NULL || column->kind == '\0')
			ereport(ERROR,
					(errcode(ERRCODE_INVALID_PARAMETER_VALUE),
					 errmsg("tensile._read_columns: kind '%c' of output column %d is none of f, d, i, t, a",
							column->kind, i + 1)));
		if (column->kind == 'f' && column->required)
		{
			column->in_matrix = true;
			column->within = reader->matrix_row_nbytes;
			reader->matrix_row_nbytes += sizeof(float4);
		}
	}
	reader->width = PG_ARGISNULL(4) ? -1 : PG_GETARG_INT32(4);
	reader->skip_holes = PG_GETARG_BOOL(5);
	reader->want_kept = PG_GETARG_BOOL(6);
	reader->max_nbytes = (Size) Max(Min(PG_GETARG_INT64(8), (int64) MAX_SCAN_NBYTES), 0);
	reader->pub.receiveSlot = reader_receive;
	reader->pub.rStartup = reader_startup;
	reader->pub.rShutdown = reader_nothing;
	reader->pub.rDestroy = reader_nothing;
	reader->pub.mydest = DestNone;
	return reader;
}

/*
 * tensile._read_columns(statement text, columns integer[], kinds text, required boolean[],
 *                       width integer, skip_holes boolean, want_kept boolean, scan_fd integer,
 *                       max_nbytes bigint) RETURNS text
 */
Datum
tensile_read_columns(PG_FUNCTION_ARGS)
{
	ColumnReader *reader;
	SPIExecuteOptions options;
	SPIPlanPtr	plan;
	text	   *result;
	int			code;
	int			i;

	/* A call from the statement of another (the user's source calling the function) could write
	 * into the outer scan's file, which stays open meanwhile: refused. */
	if (scanning)
		ereport(ERROR,
				(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
				 errmsg("tensile._read_columns cannot run inside the statement of another scan")));
	for (i = 0; i < PG_NARGS(); i++)
		if (PG_ARGISNULL(i) && i != 4)
			ereport(ERROR,
					(errcode(ERRCODE_NULL_VALUE_NOT_ALLOWED),
					 errmsg("tensile._read_columns: argument %d is NULL", i + 1)));
	reader = make_reader(fcinfo);
	open_scan_file(reader, PG_GETARG_INT32(7));
	for (i = 0; i < reader->ncolumns; i++)		/* region ncolumns + 1: the dictionaries, written at the end */
		place(reader, &reader->columns[i], i, !reader->columns[i].in_matrix);
	place(reader, &reader->kept, reader->ncolumns, reader->want_kept);
	place(reader, &reader->matrix, reader->ncolumns + 2, reader->matrix_row_nbytes > 0);

	scanning = true;
	PG_TRY();
	{
		if (SPI_connect() != SPI_OK_CONNECT)
			elog(ERROR, "tensile._read_columns: SPI_connect failed");
		plan = prepare_one(text_to_cstring(PG_GETARG_TEXT_PP(0)));
		memset(&options, 0, sizeof(options));
		options.dest = (DestReceiver *) reader;
		code = SPI_execute_plan_extended(plan, &options);
		if (code < 0)
			elog(ERROR, "tensile._read_columns: the statement failed: %s", SPI_result_code_string(code));
		SPI_finish();
	}
	PG_FINALLY();
	{
		scanning = false;
	}
	PG_END_TRY();
	result = finish(reader);
	MemoryContextDelete(reader->context);
	PG_RETURN_TEXT_P(result);
}

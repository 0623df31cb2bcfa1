//! A fast path for the commonest tensor column in Parquet: a fixed-size list
//! of float32 with no nulls (embeddings, feature vectors).
//!
//! Arrow's generic reader decodes every repetition and definition level of
//! such a column into buffers, zero-fills a values buffer, and checks every
//! list's length value by value. Here the levels are checked run by run
//! (a fixed-size list without nulls has one pattern: a repetition level of 0
//! at each record start, the maximum elsewhere, every definition level at
//! the maximum) and the values go from each page straight into the batch's
//! buffer. Pages may be PLAIN or dictionary-encoded, v1 or v2, with any codec
//! the `parquet` crate reads.
//!
//! Anything else (a null, an unexpected level or encoding) ends the fast path
//! with a [`NotFast`] reason; the reader then carries on with Arrow's generic
//! reader from the first record not yet sent, which also reports real
//! corruption with its own error.
//!
//! The Parquet reader beside it (`read/parquet.rs`) is its one user. Both
//! live in this libtorch-free crate so that it can be fuzzed: it parses
//! untrusted pages by hand, and the `float_list` fuzz target (`fuzz/`, run
//! by `scripts/fuzz.sh`) checks it against Arrow's reader as the oracle.
//!
//! The hybrid RLE / bit-packed decoder of levels and dictionary indices
//! is `float_list/hybrid.rs`; the levels' checks and the value pages are
//! here.

use std::sync::Arc;

use arrow_array::{ArrayRef, FixedSizeListArray, Float32Array};
use arrow_schema::{DataType, FieldRef};
use bytes::Bytes;
use parquet::basic::{Encoding, Type as PhysicalType};
use parquet::column::page::{Page, PageReader};
use parquet::file::metadata::ColumnChunkMetaData;
use parquet::file::reader::{ChunkReader, Length};
use parquet::file::serialized_reader::SerializedPageReader;
use parquet::schema::types::SchemaDescriptor;

mod hybrid;

use hybrid::{Hybrid, Run, bit_width};

/// Why a column (or a page of it) cannot take the fast path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NotFast(pub String);

fn not_fast(message: impl Into<String>) -> NotFast {
    NotFast(message.into())
}

/// A root field that may take the fast path: a fixed-size list of float32.
#[derive(Debug, Clone)]
pub struct FloatListField {
    /// Index of the field among the file's root fields.
    pub root: usize,
    /// Index of its one leaf column in the Parquet schema.
    pub leaf: usize,
    /// The list's item field, as the Arrow schema has it.
    pub item: FieldRef,
    pub width: usize,
}

impl FloatListField {
    /// The field when `data_type` is a fixed-size list of float32 stored as
    /// one FLOAT leaf with one repetition level.
    pub fn find(
        root: usize,
        data_type: &DataType,
        parquet_schema: &SchemaDescriptor,
    ) -> Option<Self> {
        let DataType::FixedSizeList(item, width) = data_type else {
            return None;
        };
        if item.data_type() != &DataType::Float32 || *width <= 0 {
            return None;
        }
        let mut leaves = (0..parquet_schema.num_columns())
            .filter(|&leaf| parquet_schema.get_column_root_idx(leaf) == root);
        let leaf = leaves.next()?;
        if leaves.next().is_some() {
            return None;
        }
        let column = parquet_schema.column(leaf);
        if column.physical_type() != PhysicalType::FLOAT || column.max_rep_level() != 1 {
            return None;
        }
        Some(Self {
            root,
            leaf,
            item: Arc::clone(item),
            width: *width as usize,
        })
    }

    /// Whether the column chunk's metadata allows the fast path: no nulls
    /// recorded and only encodings it decodes.
    pub fn chunk_is_eligible(meta: &ColumnChunkMetaData) -> Result<(), NotFast> {
        if let Some(nulls) = meta.statistics().and_then(|s| s.null_count_opt())
            && nulls > 0
        {
            return Err(not_fast(format!("{nulls} nulls")));
        }
        for encoding in meta.encodings() {
            match encoding {
                Encoding::PLAIN
                | Encoding::RLE
                | Encoding::RLE_DICTIONARY
                | Encoding::PLAIN_DICTIONARY => {}
                other => return Err(not_fast(format!("encoding {other}"))),
            }
        }
        Ok(())
    }
}

/// One column chunk's bytes, read with its file offsets.
struct ChunkBytes {
    start: u64,
    bytes: Bytes,
}

impl ChunkBytes {
    fn offset(&self, start: u64) -> parquet::errors::Result<u64> {
        start.checked_sub(self.start).ok_or_else(|| {
            parquet::errors::ParquetError::General(format!(
                "offset {start} is before the column chunk at {}",
                self.start
            ))
        })
    }
}

impl Length for ChunkBytes {
    fn len(&self) -> u64 {
        self.start + self.bytes.len() as u64
    }
}

impl ChunkReader for ChunkBytes {
    type T = <Bytes as ChunkReader>::T;

    fn get_read(&self, start: u64) -> parquet::errors::Result<Self::T> {
        self.bytes.get_read(self.offset(start)?)
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        self.bytes.get_bytes(self.offset(start)?, length)
    }
}

/// Where a column chunk's pages come from.
#[derive(Debug)]
pub enum ChunkSource {
    /// The chunk's bytes, read whole from a store; they start at this file
    /// offset.
    Bytes { start: u64, bytes: Bytes },
    /// A local file, read page by page: no copy of the whole chunk.
    File(std::fs::File),
}

/// Decodes one column chunk of a fixed-size float32 list, a batch of
/// records at a time.
pub struct FloatListColumn {
    pages: Box<dyn PageReader>,
    field: FloatListField,
    max_def: i16,
    dictionary: Option<Vec<f32>>,
    /// Values left in the current data page.
    current: Option<PageValues>,
    /// Values decoded so far (their level positions), across pages.
    position: u64,
}

impl std::fmt::Debug for FloatListColumn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FloatListColumn")
            .field("width", &self.field.width)
            .field("position", &self.position)
            .finish_non_exhaustive()
    }
}

enum PageValues {
    Plain {
        data: Bytes,
        /// Next byte to read.
        at: usize,
        left: usize,
    },
    Dictionary {
        indices: Hybrid,
        left: usize,
    },
}

impl FloatListColumn {
    /// The column chunk `meta` describes, of a row group of `rows` records.
    /// The caller checks [`FloatListField::chunk_is_eligible`] first, before
    /// reading any of its bytes.
    pub fn new(
        field: FloatListField,
        meta: &ColumnChunkMetaData,
        source: ChunkSource,
        rows: usize,
    ) -> Result<Self, NotFast> {
        let pages: Box<dyn PageReader> = match source {
            ChunkSource::Bytes { start, bytes } => Box::new(
                SerializedPageReader::new(Arc::new(ChunkBytes { start, bytes }), meta, rows, None)
                    .map_err(|e| not_fast(e.to_string()))?,
            ),
            ChunkSource::File(file) => Box::new(
                SerializedPageReader::new(Arc::new(file), meta, rows, None)
                    .map_err(|e| not_fast(e.to_string()))?,
            ),
        };
        Ok(Self {
            pages,
            max_def: meta.column_descr().max_def_level(),
            field,
            dictionary: None,
            current: None,
            position: 0,
        })
    }

    /// The next `rows` records as a fixed-size list array.
    pub fn take(&mut self, rows: usize) -> Result<ArrayRef, NotFast> {
        let mut values = Vec::with_capacity(rows * self.field.width);
        self.take_into(rows * self.field.width, &mut values)?;
        let values = Arc::new(Float32Array::from(values));
        let list = FixedSizeListArray::try_new(
            Arc::clone(&self.field.item),
            self.field.width as i32,
            values,
            None,
        )
        .map_err(|e| not_fast(e.to_string()))?;
        Ok(Arc::new(list))
    }

    /// Skips `rows` records.
    pub fn skip(&mut self, rows: usize) -> Result<(), NotFast> {
        let mut scratch = Vec::new();
        let mut left = rows * self.field.width;
        while left > 0 {
            let n = left.min(1 << 16);
            scratch.clear();
            self.take_into(n, &mut scratch)?;
            left -= n;
        }
        Ok(())
    }

    fn take_into(&mut self, mut n: usize, out: &mut Vec<f32>) -> Result<(), NotFast> {
        while n > 0 {
            let current = match &mut self.current {
                Some(current) => current,
                None => {
                    self.next_page()?;
                    continue;
                }
            };
            let done = match current {
                PageValues::Plain { data, at, left } => {
                    let k = n.min(*left);
                    let bytes = data
                        .get(*at..*at + 4 * k)
                        .ok_or_else(|| not_fast("a PLAIN page ends early"))?;
                    out.extend(plain_f32s(bytes));
                    *at += 4 * k;
                    *left -= k;
                    n -= k;
                    *left == 0
                }
                PageValues::Dictionary { indices, left } => {
                    let dictionary = self.dictionary.as_deref().ok_or_else(|| {
                        not_fast("a dictionary-encoded page without a dictionary")
                    })?;
                    let k = n.min(*left);
                    indices.lookup(k, dictionary, out)?;
                    *left -= k;
                    n -= k;
                    *left == 0
                }
            };
            if done {
                self.current = None;
            }
        }
        Ok(())
    }

    /// Reads pages up to the next data page, checks its levels and makes
    /// it current.
    fn next_page(&mut self) -> Result<(), NotFast> {
        loop {
            let page = self
                .pages
                .get_next_page()
                .map_err(|e| not_fast(e.to_string()))?
                .ok_or_else(|| not_fast("the column chunk ends early"))?;
            match page {
                Page::DictionaryPage {
                    buf,
                    num_values,
                    encoding,
                    ..
                } => {
                    if !matches!(encoding, Encoding::PLAIN | Encoding::PLAIN_DICTIONARY) {
                        return Err(not_fast(format!("dictionary page encoding {encoding}")));
                    }
                    let n = num_values as usize;
                    let bytes = buf
                        .get(..4 * n)
                        .ok_or_else(|| not_fast("the dictionary page ends early"))?;
                    self.dictionary = Some(plain_f32s(bytes).collect());
                }
                Page::DataPage {
                    buf,
                    num_values,
                    encoding,
                    def_level_encoding,
                    rep_level_encoding,
                    ..
                } => {
                    if rep_level_encoding != Encoding::RLE || def_level_encoding != Encoding::RLE {
                        return Err(not_fast(format!(
                            "level encodings {rep_level_encoding}/{def_level_encoding}"
                        )));
                    }
                    let n = num_values as usize;
                    let (rep, rest) = prefixed(&buf, 0)?;
                    let (def, values_at) = if self.max_def > 0 {
                        prefixed(&buf, rest)?
                    } else {
                        (0..0, rest)
                    };
                    self.check_levels(buf.slice(rep), buf.slice(def), n)?;
                    self.start_values(buf.slice(values_at..), encoding, n)?;
                    return Ok(());
                }
                Page::DataPageV2 {
                    buf,
                    num_values,
                    encoding,
                    num_nulls,
                    def_levels_byte_len,
                    rep_levels_byte_len,
                    ..
                } => {
                    if num_nulls > 0 {
                        return Err(not_fast(format!("{num_nulls} nulls in a page")));
                    }
                    let n = num_values as usize;
                    let rep_end = rep_levels_byte_len as usize;
                    let def_end = rep_end + def_levels_byte_len as usize;
                    if def_end > buf.len() {
                        return Err(not_fast("a v2 page's levels overrun it"));
                    }
                    self.check_levels(buf.slice(..rep_end), buf.slice(rep_end..def_end), n)?;
                    self.start_values(buf.slice(def_end..), encoding, n)?;
                    return Ok(());
                }
            }
        }
    }

    fn start_values(&mut self, data: Bytes, encoding: Encoding, n: usize) -> Result<(), NotFast> {
        self.current = Some(match encoding {
            Encoding::PLAIN => {
                if data.len() < 4 * n {
                    return Err(not_fast("a PLAIN page holds fewer values than it says"));
                }
                PageValues::Plain {
                    data,
                    at: 0,
                    left: n,
                }
            }
            Encoding::RLE_DICTIONARY | Encoding::PLAIN_DICTIONARY => {
                let bit_width = *data
                    .first()
                    .ok_or_else(|| not_fast("an empty dictionary-encoded page"))?;
                if bit_width > 32 {
                    return Err(not_fast(format!("index bit width {bit_width}")));
                }
                PageValues::Dictionary {
                    indices: Hybrid::new(data.slice(1..), bit_width),
                    left: n,
                }
            }
            other => return Err(not_fast(format!("value encoding {other}"))),
        });
        if n == 0 {
            self.current = None;
        }
        Ok(())
    }

    /// Checks that `n` levels from the current position are those of
    /// fixed-size lists without nulls, and moves the position past them.
    fn check_levels(&mut self, rep: Bytes, def: Bytes, n: usize) -> Result<(), NotFast> {
        let width = self.field.width as u64;
        let start = self.position;
        if self.max_def > 0 {
            let max = self.max_def as u32;
            let mut def = Hybrid::new(def, bit_width(self.max_def));
            def.for_each_run(n, |_, run| match run {
                Run::Repeat(value, _) if value == max => Ok(()),
                Run::Repeat(..) => Err(not_fast("a null or empty list")),
                Run::Values(values) => {
                    if values.iter().all(|&v| v == max) {
                        Ok(())
                    } else {
                        Err(not_fast("a null or empty list"))
                    }
                }
            })?;
        }
        let mut rep = Hybrid::new(rep, 1);
        rep.for_each_run(n, |at, run| {
            let at = start + at as u64;
            match run {
                Run::Repeat(0, count) => {
                    // Record starts only: every one of them at a multiple of the width.
                    if width == 1 || (count == 1 && at.is_multiple_of(width)) {
                        Ok(())
                    } else {
                        Err(not_fast("lists of another length"))
                    }
                }
                Run::Repeat(_, count) => {
                    // Inside one list: no record start in [at, at + count).
                    let inside = at % width;
                    if inside != 0 && inside + count as u64 <= width {
                        Ok(())
                    } else {
                        Err(not_fast("lists of another length"))
                    }
                }
                Run::Values(values) => {
                    for (i, &v) in values.iter().enumerate() {
                        if (v == 0) != (at + i as u64).is_multiple_of(width) {
                            return Err(not_fast("lists of another length"));
                        }
                    }
                    Ok(())
                }
            }
        })?;
        self.position += n as u64;
        Ok(())
    }
}

/// PLAIN-encoded float32 values (little-endian, 4 bytes each).
fn plain_f32s(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes.chunks_exact(4).map(|b| {
        let mut le = [0u8; 4];
        le.copy_from_slice(b);
        f32::from_le_bytes(le)
    })
}

/// A v1 page's levels: a 4-byte little-endian length, then that many bytes.
fn prefixed(buf: &[u8], at: usize) -> Result<(std::ops::Range<usize>, usize), NotFast> {
    let len = buf
        .get(at..at + 4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .ok_or_else(|| not_fast("a page ends inside its levels"))?;
    let end = at + 4 + len;
    if end > buf.len() {
        return Err(not_fast("a page's levels overrun it"));
    }
    Ok((at + 4..end, end))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use arrow_array::cast::AsArray;
    use arrow_array::{Array, RecordBatch};
    use arrow_schema::{Field, Schema};
    use parquet::arrow::ArrowWriter;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    use parquet::basic::Compression;
    use parquet::file::properties::{WriterProperties, WriterVersion};

    fn lists(rows: usize, width: usize, seed: u32, nullable_item: bool) -> FixedSizeListArray {
        // A few repeated values too, so dictionaries have something to do.
        let values: Vec<f32> = (0..rows * width)
            .map(|i| {
                let x = (i as u32).wrapping_mul(2654435761).wrapping_add(seed);
                if i % 7 == 0 { 0.5 } else { x as f32 / 1e6 }
            })
            .collect();
        FixedSizeListArray::try_new(
            Arc::new(Field::new("item", DataType::Float32, nullable_item)),
            width as i32,
            Arc::new(Float32Array::from(values)),
            None,
        )
        .unwrap()
    }

    fn write(column: ArrayRef, props: WriterProperties) -> Bytes {
        let schema = Arc::new(Schema::new(vec![Field::new(
            "x",
            column.data_type().clone(),
            true,
        )]));
        let batch = RecordBatch::try_new(Arc::clone(&schema), vec![column]).unwrap();
        let mut out = Vec::new();
        let mut writer = ArrowWriter::try_new(&mut out, schema, Some(props)).unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
        Bytes::from(out)
    }

    /// Every row group read in `step`-record takes after skipping `skip`.
    fn fast_read(file: &Bytes, skip: usize, step: usize) -> Result<Vec<ArrayRef>, NotFast> {
        let builder = ParquetRecordBatchReaderBuilder::try_new(file.clone()).unwrap();
        let schema = Arc::clone(builder.schema());
        let meta = builder.metadata().clone();
        let field = FloatListField::find(
            0,
            schema.field(0).data_type(),
            meta.file_metadata().schema_descr(),
        )
        .ok_or_else(|| not_fast("not a fixed-size float list"))?;
        let mut out = Vec::new();
        for rg in meta.row_groups() {
            let chunk = rg.column(field.leaf);
            FloatListField::chunk_is_eligible(chunk)?;
            let (start, len) = chunk.byte_range();
            let bytes = file.slice(start as usize..(start + len) as usize);
            let rows = rg.num_rows() as usize;
            let source = ChunkSource::Bytes { start, bytes };
            let mut column = FloatListColumn::new(field.clone(), chunk, source, rows)?;
            column.skip(skip)?;
            let mut at = skip;
            while at < rows {
                let n = step.min(rows - at);
                out.push(column.take(n)?);
                at += n;
            }
        }
        Ok(out)
    }

    fn generic_values(file: &Bytes) -> Vec<f32> {
        let builder = ParquetRecordBatchReaderBuilder::try_new(file.clone()).unwrap();
        let meta = builder.metadata().clone();
        let mut out = Vec::new();
        for g in 0..meta.num_row_groups() {
            let reader = ParquetRecordBatchReaderBuilder::try_new(file.clone())
                .unwrap()
                .with_row_groups(vec![g])
                .build()
                .unwrap();
            for batch in reader {
                let batch = batch.unwrap();
                let list = batch.column(0).as_fixed_size_list();
                let width = list.value_length() as usize;
                let values = list
                    .values()
                    .as_primitive::<arrow_array::types::Float32Type>();
                out.extend_from_slice(&values.values()[0..list.len() * width]);
            }
        }
        out
    }

    fn flat(arrays: &[ArrayRef]) -> Vec<f32> {
        let mut out = Vec::new();
        for a in arrays {
            let list = a.as_fixed_size_list();
            let values = list
                .values()
                .as_primitive::<arrow_array::types::Float32Type>();
            out.extend_from_slice(values.values());
        }
        out
    }

    #[test]
    fn fast_path_matches_arrows_reader_across_page_kinds() {
        let cases: Vec<(&str, WriterProperties)> = vec![
            ("defaults", WriterProperties::builder().build()),
            (
                "plain, snappy, small pages",
                WriterProperties::builder()
                    .set_dictionary_enabled(false)
                    .set_compression(Compression::SNAPPY)
                    .set_data_page_size_limit(4096)
                    .set_write_batch_size(64)
                    .build(),
            ),
            (
                "dictionary falling back to plain (like pyarrow), zstd",
                WriterProperties::builder()
                    .set_dictionary_page_size_limit(2048)
                    .set_data_page_size_limit(4096)
                    .set_write_batch_size(64)
                    .set_compression(Compression::ZSTD(Default::default()))
                    .build(),
            ),
            (
                "v2 pages, several row groups",
                WriterProperties::builder()
                    .set_writer_version(WriterVersion::PARQUET_2_0)
                    .set_max_row_group_row_count(Some(300))
                    .set_data_page_size_limit(2048)
                    .set_write_batch_size(32)
                    .build(),
            ),
        ];
        for (width, rows) in [(8usize, 1000usize), (1, 700), (33, 257)] {
            for nullable_item in [true, false] {
                let column: ArrayRef = Arc::new(lists(rows, width, 7, nullable_item));
                for (name, props) in &cases {
                    let file = write(Arc::clone(&column), props.clone());
                    let want = generic_values(&file);
                    assert_eq!(want.len(), rows * width, "{name}");
                    for step in [1, 100, 4096] {
                        let got = fast_read(&file, 0, step).unwrap_or_else(|e| {
                            panic!("{name}, width {width}: fast path refused: {e}")
                        });
                        assert_eq!(flat(&got), want, "{name}, width {width}, step {step}");
                        for a in &got {
                            assert_eq!(a.data_type(), column.data_type());
                            assert_eq!(a.null_count(), 0);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn skipping_records_lands_on_the_same_values() {
        let width = 5;
        let column: ArrayRef = Arc::new(lists(400, width, 3, true));
        let props = WriterProperties::builder()
            .set_dictionary_page_size_limit(512)
            .set_data_page_size_limit(1024)
            .set_write_batch_size(16)
            .build();
        let file = write(column, props);
        let all = generic_values(&file);
        for skip in [0, 1, 37, 399] {
            let got = flat(&fast_read(&file, skip, 64).unwrap());
            assert_eq!(got, all[skip * width..], "skip {skip}");
        }
    }

    #[test]
    fn nulls_end_the_fast_path() {
        let width = 4;
        let base = lists(50, width, 1, true);
        // A null list at record 20.
        let mut valid = vec![true; 50];
        valid[20] = false;
        let with_null_list: ArrayRef = Arc::new(
            FixedSizeListArray::try_new(
                Arc::new(Field::new("item", DataType::Float32, true)),
                width as i32,
                Arc::clone(base.values()),
                Some(valid.into()),
            )
            .unwrap(),
        );
        // A null value inside record 3.
        let mut values: Vec<Option<f32>> = (0..50 * width).map(|i| Some(i as f32)).collect();
        values[13] = None;
        let with_null_item: ArrayRef = Arc::new(
            FixedSizeListArray::try_new(
                Arc::new(Field::new("item", DataType::Float32, true)),
                width as i32,
                Arc::new(Float32Array::from(values)),
                None,
            )
            .unwrap(),
        );
        for column in [with_null_list, with_null_item] {
            // Without statistics, the levels catch it; with them, the metadata does.
            for stats in [false, true] {
                let props = WriterProperties::builder()
                    .set_statistics_enabled(if stats {
                        parquet::file::properties::EnabledStatistics::Chunk
                    } else {
                        parquet::file::properties::EnabledStatistics::None
                    })
                    .build();
                let file = write(Arc::clone(&column), props);
                let err = fast_read(&file, 0, 10).unwrap_err();
                assert!(
                    err.0.contains("null"),
                    "stats {stats}: unexpected reason {err}"
                );
            }
        }
    }

    #[test]
    fn other_columns_are_not_candidates() {
        let ints: ArrayRef = Arc::new(
            FixedSizeListArray::try_new(
                Arc::new(Field::new("item", DataType::Int32, true)),
                2,
                Arc::new(arrow_array::Int32Array::from(vec![1, 2, 3, 4])),
                None,
            )
            .unwrap(),
        );
        let variable: ArrayRef = Arc::new(arrow_array::ListArray::from_iter_primitive::<
            arrow_array::types::Float32Type,
            _,
            _,
        >(vec![Some(vec![Some(1.0), Some(2.0)])]));
        for column in [ints, variable] {
            let file = write(column, WriterProperties::builder().build());
            assert!(fast_read(&file, 0, 1).is_err());
        }
    }
}

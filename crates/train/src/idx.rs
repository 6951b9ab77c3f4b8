//! Parser for the IDX format of MNIST and Fashion-MNIST.
//!
//! An IDX file is a big-endian header followed by raw `u8` data:
//!
//! | file   | magic        | header                          | data                 |
//! |--------|--------------|---------------------------------|----------------------|
//! | images | `0x00000803` | magic, count, rows, cols (u32s) | `count * rows * cols` |
//! | labels | `0x00000801` | magic, count (u32s)             | `count`              |
//!
//! Files may be gzip-compressed; [`gunzip_if_needed`] detects the gzip magic `1f 8b` and
//! inflates transparently, so `.gz` and plain files are handled the same way. The byte
//! length must match the header exactly, so a truncated download is an error that names
//! the file rather than a silently short dataset.

use std::borrow::Cow;
use std::io::Read;
use std::path::Path;

use crate::TrainError;

/// Magic number of an IDX file of `u8` images with 3 dimensions `[count, rows, cols]`.
pub const IMAGES_MAGIC: u32 = 0x0000_0803;
/// Magic number of an IDX file of `u8` labels with 1 dimension `[count]`.
pub const LABELS_MAGIC: u32 = 0x0000_0801;

/// Images decoded from an IDX file: `count` images of `rows x cols` pixels, row-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdxImages {
    /// Number of images.
    pub count: usize,
    /// Pixel rows per image.
    pub rows: usize,
    /// Pixel columns per image.
    pub cols: usize,
    /// `count * rows * cols` pixels, image after image, each row-major (0 = background).
    pub pixels: Vec<u8>,
}

impl IdxImages {
    /// Pixels per image (`rows * cols`).
    pub fn pixels_per_image(&self) -> usize {
        self.rows * self.cols
    }
}

/// Inflates `bytes` if they start with the gzip magic `1f 8b`, else borrows them.
/// `file` names the source in errors.
pub fn gunzip_if_needed<'a>(bytes: &'a [u8], file: &str) -> Result<Cow<'a, [u8]>, TrainError> {
    if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::with_capacity(bytes.len() * 4);
        flate2::read::GzDecoder::new(bytes)
            .read_to_end(&mut out)
            .map_err(|e| TrainError::CorruptIdx { file: file.to_owned(), reason: format!("bad gzip stream ({e})") })?;
        Ok(Cow::Owned(out))
    } else {
        Ok(Cow::Borrowed(bytes))
    }
}

/// Reads the big-endian u32 header fields, or reports a short file.
fn header(bytes: &[u8], fields: usize, file: &str) -> Result<Vec<u32>, TrainError> {
    if bytes.len() < fields * 4 {
        return Err(TrainError::CorruptIdx {
            file: file.to_owned(),
            reason: format!("only {} bytes, shorter than the {}-byte IDX header", bytes.len(), fields * 4),
        });
    }
    Ok(bytes[..fields * 4].chunks_exact(4).map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]])).collect())
}

fn check_magic(bytes: &[u8], expected: u32, kind: &'static str, file: &str) -> Result<(), TrainError> {
    let magic = header(bytes, 1, file)?[0];
    if magic != expected {
        return Err(TrainError::BadMagic { file: file.to_owned(), expected_kind: kind, found: magic, expected });
    }
    Ok(())
}

fn check_len(bytes: &[u8], header_len: usize, dims: &[usize], file: &str) -> Result<usize, TrainError> {
    let data_len = dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)).ok_or_else(|| {
        TrainError::CorruptIdx { file: file.to_owned(), reason: format!("dimensions {dims:?} overflow") }
    })?;
    let expected = header_len + data_len;
    if bytes.len() != expected {
        let what = if bytes.len() < expected { "truncated" } else { "has trailing bytes" };
        return Err(TrainError::CorruptIdx {
            file: file.to_owned(),
            reason: format!("{what}: {} bytes, but dimensions {dims:?} need exactly {expected}", bytes.len()),
        });
    }
    Ok(data_len)
}

/// Parses an IDX images file (plain or gzip). `file` names the source in errors.
pub fn parse_images(bytes: &[u8], file: &str) -> Result<IdxImages, TrainError> {
    let bytes = gunzip_if_needed(bytes, file)?;
    check_magic(&bytes, IMAGES_MAGIC, "images", file)?;
    let h = header(&bytes, 4, file)?;
    let (count, rows, cols) = (h[1] as usize, h[2] as usize, h[3] as usize);
    if rows == 0 || cols == 0 {
        return Err(TrainError::CorruptIdx {
            file: file.to_owned(),
            reason: format!("image size {rows}x{cols} is empty"),
        });
    }
    check_len(&bytes, 16, &[count, rows, cols], file)?;
    let pixels = match bytes {
        Cow::Owned(mut v) => {
            v.drain(..16);
            v
        }
        Cow::Borrowed(b) => b[16..].to_vec(),
    };
    Ok(IdxImages { count, rows, cols, pixels })
}

/// Parses an IDX labels file (plain or gzip). `file` names the source in errors.
pub fn parse_labels(bytes: &[u8], file: &str) -> Result<Vec<u8>, TrainError> {
    let bytes = gunzip_if_needed(bytes, file)?;
    check_magic(&bytes, LABELS_MAGIC, "labels", file)?;
    let count = header(&bytes, 2, file)?[1] as usize;
    check_len(&bytes, 8, &[count], file)?;
    Ok(bytes[8..].to_vec())
}

fn read(path: &Path) -> Result<Vec<u8>, TrainError> {
    std::fs::read(path).map_err(|source| TrainError::Io { path: path.to_owned(), source })
}

/// Reads and parses an IDX images file from disk (plain or gzip).
pub fn read_images(path: &Path) -> Result<IdxImages, TrainError> {
    parse_images(&read(path)?, &path.display().to_string())
}

/// Reads and parses an IDX labels file from disk (plain or gzip).
pub fn read_labels(path: &Path) -> Result<Vec<u8>, TrainError> {
    parse_labels(&read(path)?, &path.display().to_string())
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn images_bytes(count: u32, rows: u32, cols: u32) -> Vec<u8> {
        let mut b = Vec::new();
        for v in [IMAGES_MAGIC, count, rows, cols] {
            b.extend_from_slice(&v.to_be_bytes());
        }
        b.extend((0..count * rows * cols).map(|i| (i % 256) as u8));
        b
    }

    fn labels_bytes(labels: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&LABELS_MAGIC.to_be_bytes());
        b.extend_from_slice(&(labels.len() as u32).to_be_bytes());
        b.extend_from_slice(labels);
        b
    }

    fn gz(bytes: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(bytes).unwrap();
        e.finish().unwrap()
    }

    #[test]
    fn parses_good_images_and_labels() {
        let img = parse_images(&images_bytes(3, 2, 4), "img").unwrap();
        assert_eq!((img.count, img.rows, img.cols), (3, 2, 4));
        assert_eq!(img.pixels.len(), 24);
        assert_eq!(img.pixels[5], 5);
        assert_eq!(parse_labels(&labels_bytes(&[1, 2, 9]), "lab").unwrap(), vec![1, 2, 9]);
    }

    #[test]
    fn parses_gzip_transparently() {
        let plain = images_bytes(5, 3, 3);
        assert_eq!(parse_images(&gz(&plain), "img.gz").unwrap(), parse_images(&plain, "img").unwrap());
        assert_eq!(parse_labels(&gz(&labels_bytes(&[7, 0])), "lab.gz").unwrap(), vec![7, 0]);
    }

    #[test]
    fn rejects_truncated_and_trailing_bytes() {
        let mut b = images_bytes(3, 2, 2);
        b.pop();
        let err = parse_images(&b, "short-file").unwrap_err().to_string();
        assert!(err.contains("short-file") && err.contains("truncated"), "{err}");
        let mut b = labels_bytes(&[1, 2]);
        b.push(0);
        let err = parse_labels(&b, "long-file").unwrap_err().to_string();
        assert!(err.contains("long-file") && err.contains("trailing"), "{err}");
        let err = parse_labels(&[0, 0, 8], "tiny").unwrap_err().to_string();
        assert!(err.contains("tiny") && err.contains("header"), "{err}");
        // A truncated gzip stream is also an error naming the file.
        let z = gz(&images_bytes(10, 4, 4));
        let err = parse_images(&z[..z.len() / 2], "cut.gz").unwrap_err().to_string();
        assert!(err.contains("cut.gz"), "{err}");
    }

    #[test]
    fn rejects_bad_magic() {
        // A labels file passed as images and vice versa.
        let err = parse_images(&labels_bytes(&[1]), "labels-as-images").unwrap_err();
        assert!(matches!(err, TrainError::BadMagic { found: LABELS_MAGIC, .. }), "{err}");
        assert!(err.to_string().contains("labels-as-images"));
        let err = parse_labels(&images_bytes(1, 1, 1), "images-as-labels").unwrap_err();
        assert!(matches!(err, TrainError::BadMagic { found: IMAGES_MAGIC, .. }), "{err}");
    }

    #[test]
    fn rejects_empty_image_size() {
        let err = parse_images(&images_bytes(0, 0, 5), "zero").unwrap_err().to_string();
        assert!(err.contains("empty"), "{err}");
    }
}

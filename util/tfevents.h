/*
 * tfevents — a writer of TensorBoard event files, so that `tensorboard
 * --logdir DIR` shows rumor's figures (rumor train/peer/group/top
 * --tensorboard DIR). Written here rather than taken from a library: the
 * format is a few dozen lines (below), and the libraries that write it
 * bring TensorFlow or protobuf with them.
 *
 * The file is a TFRecord stream: each record is
 *
 *   uint64 length (little-endian) | uint32 masked CRC32C of those 8 bytes |
 *   the data | uint32 masked CRC32C of the data
 *
 * with masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8 and CRC32C the
 * Castagnoli CRC (reflected polynomial 0x82F63B78). Each record's data is a
 * protobuf `tensorflow.Event` (tensorflow/core/util/event.proto), encoded
 * by hand: wall_time (field 1, double, Unix seconds), step (field 2, int64),
 * and either file_version (field 3, "brain.Event:2", the first record of
 * every file) or summary (field 5): a `Summary` with one `Summary.Value`
 * (field 1) holding tag (field 1, string) and simple_value (field 2, float).
 *
 * A writer owns one file, DIR/RUN/events.out.tfevents.<unix seconds>.<host>.
 * <pid>.rumor (".rumor.<n>" appended when that name exists), and is used by
 * one thread at a time.
 */
#ifndef RUMOR_UTIL_TFEVENTS_H
#define RUMOR_UTIL_TFEVENTS_H

#include <stddef.h>
#include <stdint.h>

#include "util/util.h"

#define TB_FILE_VERSION "brain.Event:2"
#define TB_TAG_MAX 256   /* longest tag written; longer ones are dropped with a warning */
#define TB_RUN_MAX 128   /* longest run name */
#define TB_MASK_DELTA 0xa282ead8u
#define TB_BUF_BYTES (64u << 10) /* records buffered before a write */

typedef struct tb_writer tb_writer_t;

/* CRC32C (Castagnoli) of n bytes, continuing from `crc` (0 to start):
 * crc32c(0, "123456789", 9) == 0xE3069283. */
uint32_t tb_crc32c(uint32_t crc, const void *data, size_t n);
/* The TFRecord mask of a CRC (above). */
uint32_t tb_crc_mask(uint32_t crc);

/* Creates DIR and DIR/RUN when missing (like mkdir -p), and a new event
 * file in DIR/RUN holding the file_version record. `run` is one path
 * component: not empty, at most TB_RUN_MAX bytes, no '/', not "." or "..".
 * Returns the writer, or NULL with a message naming the path and the cause
 * in `e` (RUMOR_EFORMAT for a bad run name, a negative errno otherwise). */
tb_writer_t *tb_open(const char *dir, const char *run, struct rumor_err *e);

/* Appends one scalar: `value` (stored as a float) under `tag` at training
 * step `step`, stamped with the current wall time. Buffered (written when
 * TB_BUF_BYTES have gathered): a live TensorBoard sees it after tb_flush.
 * A write error is logged once (naming the file), the file is cut back to
 * its last whole record, and the writer drops everything after it; the
 * caller never has to stop for it. */
void tb_scalar(tb_writer_t *w, const char *tag, int64_t step, double value);
/* Hands the buffered records to the kernel (no fsync). */
void tb_flush(tb_writer_t *w);
/* 0, or the negative errno of the first write error (everything after it
 * was dropped). */
int tb_status(const tb_writer_t *w);
/* The event file's path. */
const char *tb_path(const tb_writer_t *w);
/* Flushes, closes and frees (NULL is a no-op). */
void tb_close(tb_writer_t *w);

#endif /* RUMOR_UTIL_TFEVENTS_H */

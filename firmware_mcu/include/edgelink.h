/*
 * edgelink: the serial link between an MCU sensor node and the edgerun node.
 *
 * Compile-time options (define before including, or with -D):
 *   EL_MAX_PAYLOAD   largest message payload in bytes (default 240; OTA chunks are sized to fit)
 *   EL_MAX_LOG       largest LOG text in bytes (default EL_MAX_PAYLOAD - 1)
 *
 * Wire format (all integers little-endian), one frame:
 *   COBS( version:u8 | type:u8 | seq:u16 | len:u16 | payload[len] | crc32c:u32 ) 0x00
 * The CRC-32C (Castagnoli) covers every byte before it. A 0x00 byte ends a frame, so a
 * receiver that starts mid-stream or meets garbage resynchronises at the next 0x00.
 *
 * No function allocates; the caller owns every buffer. Every function that can fail
 * returns a status the caller must check.
 */
#ifndef EDGELINK_H
#define EDGELINK_H

#include <stddef.h>
#include <stdint.h>

#ifndef EL_MAX_PAYLOAD
#define EL_MAX_PAYLOAD 240
#endif
#ifndef EL_MAX_LOG
#define EL_MAX_LOG (EL_MAX_PAYLOAD - 1)
#endif

#define EL_VERSION 1u
#define EL_HEADER_LEN 6u
#define EL_CRC_LEN 4u
#define EL_MAX_FRAME (EL_HEADER_LEN + EL_MAX_PAYLOAD + EL_CRC_LEN)
/* COBS adds one byte per 254 and one up front; the delimiter adds one more. */
#define EL_MAX_ENCODED (EL_MAX_FRAME + EL_MAX_FRAME / 254u + 2u)

#define EL_HELLO_LEN 36u
#define EL_DETECTION_LEN 16u
#define EL_HEARTBEAT_LEN 16u
#define EL_MANIFEST_LEN 64u
#define EL_KEY_ID_LEN 8u
#define EL_SIGNATURE_LEN 64u
#define EL_OTA_BEGIN_LEN (EL_MANIFEST_LEN + EL_KEY_ID_LEN + EL_SIGNATURE_LEN)
#define EL_OTA_CHUNK_HEADER 4u
#define EL_MAX_CHUNK (EL_MAX_PAYLOAD - EL_OTA_CHUNK_HEADER)
#define EL_ACK_LEN 8u
#define EL_MODEL_NAME_LEN 16u

#if EL_MAX_PAYLOAD < EL_OTA_BEGIN_LEN || EL_MAX_PAYLOAD > 65535
#error "EL_MAX_PAYLOAD must hold an OTA_BEGIN (136 bytes) and fit in 16 bits"
#endif

typedef enum {
    EL_OK = 0,
    EL_ERR_ARG = 1,     /* a NULL pointer or an out-of-range argument */
    EL_ERR_SPACE = 2,   /* the output buffer is too small */
    EL_ERR_LENGTH = 3,  /* a payload length does not fit its message type */
    EL_ERR_TYPE = 4,    /* unknown message type */
    EL_ERR_COBS = 5     /* not valid COBS */
} el_status;

typedef enum {
    EL_MSG_HELLO = 0x01,
    EL_MSG_DETECTION = 0x02,
    EL_MSG_HEARTBEAT = 0x03,
    EL_MSG_LOG = 0x04,
    EL_MSG_OTA_BEGIN = 0x10,
    EL_MSG_OTA_CHUNK = 0x11,
    EL_MSG_OTA_END = 0x12,
    EL_MSG_ACK = 0x20,
    EL_MSG_NACK = 0x21
} el_msg_type;

/* Why a NACK refused a message; shared with edgerun/mcu/protocol.py. */
typedef enum {
    EL_NACK_MALFORMED = 1,
    EL_NACK_UNKNOWN_TYPE = 2,
    EL_NACK_UNKNOWN_KEY = 3,
    EL_NACK_BAD_SIGNATURE = 4,
    EL_NACK_BAD_MANIFEST = 5,
    EL_NACK_ROLLBACK = 6,
    EL_NACK_TOO_LARGE = 7,
    EL_NACK_NO_SESSION = 8,
    EL_NACK_BAD_OFFSET = 9,
    EL_NACK_INCOMPLETE = 10,
    EL_NACK_HASH_MISMATCH = 11,
    EL_NACK_STORAGE = 12
} el_nack_reason;

/* What one byte pushed into the decoder produced. Values >= EL_RX_TOO_LONG are dropped frames. */
typedef enum {
    EL_RX_PENDING = 0,
    EL_RX_FRAME = 1,
    EL_RX_TOO_LONG = 2,     /* more than EL_MAX_ENCODED - 1 bytes before a delimiter, or decoded longer than EL_MAX_FRAME */
    EL_RX_BAD_COBS = 3,
    EL_RX_TOO_SHORT = 4,    /* fewer bytes than a header and a CRC */
    EL_RX_BAD_CRC = 5,
    EL_RX_BAD_VERSION = 6,
    EL_RX_BAD_LENGTH = 7    /* the header's length disagrees with the frame's */
} el_rx_result;
#define EL_RX_RESULT_COUNT 8

typedef struct {
    uint8_t type;
    uint16_t seq;
    uint16_t len;
    const uint8_t *payload; /* points into the decoder; valid until the next push */
} el_frame;

typedef struct {
    uint32_t device_id;
    uint32_t fw_version;
    uint32_t model_version;
    uint16_t frame_width;
    uint16_t frame_height;
    uint8_t active_slot;
    uint8_t flags;
    char model_name[EL_MODEL_NAME_LEN]; /* NUL-padded, not necessarily NUL-terminated */
} el_hello;

typedef struct {
    uint32_t timestamp_ms;
    uint16_t class_id;
    uint16_t score_q16; /* score * 65535 */
    uint16_t box[4];    /* x1, y1, x2, y2 in sensor-frame pixels */
} el_detection;

typedef struct {
    uint32_t uptime_ms;
    uint32_t detections_sent;
    uint32_t detections_dropped; /* no room in the MCU's transmit buffer */
    uint32_t rx_bad_frames;
} el_heartbeat;

typedef struct {
    uint8_t level;
    uint16_t text_len;
    char text[EL_MAX_LOG];
} el_log;

typedef struct {
    uint8_t manifest[EL_MANIFEST_LEN];
    uint8_t key_id[EL_KEY_ID_LEN];
    uint8_t signature[EL_SIGNATURE_LEN];
} el_ota_begin;

typedef struct {
    uint32_t offset;
    uint16_t len;
    const uint8_t *data; /* points into the frame on decode, the caller's buffer on encode */
} el_ota_chunk;

typedef struct {
    uint8_t acked_type;
    uint8_t reason; /* el_nack_reason for a NACK, 0 for an ACK */
    uint16_t acked_seq;
    uint32_t value; /* OTA: the next offset the MCU expects, or the model version after OTA_END */
} el_ack;

typedef struct {
    uint8_t type;
    uint16_t seq;
    union {
        el_hello hello;
        el_detection detection;
        el_heartbeat heartbeat;
        el_log log;
        el_ota_begin ota_begin;
        el_ota_chunk ota_chunk;
        el_ack ack; /* ACK and NACK */
    } u;
} el_message;

typedef struct {
    uint8_t buf[EL_MAX_ENCODED - 1u]; /* a frame's COBS bytes, without the delimiter */
    uint8_t frame[EL_MAX_ENCODED];    /* decoded; longer than EL_MAX_FRAME is refused as too long */
    size_t used;
    uint8_t discarding; /* overflowed: drop bytes until the next delimiter */
} el_decoder;

uint32_t el_crc32c(uint32_t crc, const uint8_t *data, size_t len);

el_status el_cobs_encode(const uint8_t *in, size_t in_len, uint8_t *out, size_t out_cap, size_t *out_len);
el_status el_cobs_decode(const uint8_t *in, size_t in_len, uint8_t *out, size_t out_cap, size_t *out_len);

/* A whole frame, COBS-encoded, with its trailing 0x00 delimiter. */
el_status el_frame_encode(uint8_t type, uint16_t seq, const uint8_t *payload, uint16_t len, uint8_t *out,
                          size_t out_cap, size_t *out_len);

void el_decoder_init(el_decoder *d);
/* Feed one received byte; on EL_RX_FRAME, *frame is filled. */
el_rx_result el_decoder_push(el_decoder *d, uint8_t byte, el_frame *frame);
const char *el_rx_result_name(el_rx_result r);

/* The payload of a message (no framing). */
el_status el_payload_encode(const el_message *m, uint8_t *out, size_t out_cap, size_t *out_len);
/* A message as a whole encoded frame. */
el_status el_message_encode(const el_message *m, uint8_t *out, size_t out_cap, size_t *out_len);
/* A decoded frame as a typed message; EL_ERR_TYPE or EL_ERR_LENGTH when it does not parse. */
el_status el_message_decode(const el_frame *f, el_message *m);

#endif

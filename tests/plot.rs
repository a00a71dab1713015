//! The PNG charts decode, have the expected size, and draw each series in its colour.

use lily::plot::{Chart, Series, PALETTE};

#[test]
fn chart_is_a_valid_png_with_the_series_drawn() {
    let chart = Chart {
        title: "Decode, batch 1".into(),
        x_label: "context (tokens)".into(),
        y_label: "tok/s".into(),
        series: vec![
            Series {
                name: "lily".into(),
                color: PALETTE[0],
                points: vec![(256.0, 1500.0), (4096.0, 1300.0), (131072.0, 700.0)],
            },
            Series {
                name: "peer".into(),
                color: PALETTE[1],
                points: vec![(256.0, 200.0), (4096.0, 180.0)],
            },
        ],
    };
    let png = chart.to_png();
    let decoder = png::Decoder::new(std::io::Cursor::new(png));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!((info.width, info.height), (900, 560));
    let count = |c: [u8; 3]| buf.chunks(3).filter(|p| *p == c).count();
    assert!(count(PALETTE[0]) > 500, "first series barely drawn");
    assert!(count(PALETTE[1]) > 300, "second series barely drawn");
}
